"""genie/csrc is laid out like the Python (device/, server/, wire/), every source is built by exactly one
extension of setup.py (a header by none), and docs/architecture.md's layout index names every file.

Reads files only: nothing is built or imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "genie" / "csrc"
FOLDERS = {"device", "server", "wire"}


def _sources() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob("*") if p.is_file() and p.suffix in (".cpp", ".h"))


def _built() -> dict[str, list[str]]:
    """Each extension of setup.py and its sources, as the setup() call lists them (evaluated from the AST)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    names: dict[str, object] = {}
    for node in tree.body:  # the module-level constants the source lists are made of
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                names[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    built: dict[str, list[str]] = {}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                and call.func.id in ("CppExtension", "Extension") and len(call.args) >= 2:
            name = ast.literal_eval(call.args[0])
            code = compile(ast.Expression(call.args[1]), "setup.py", "eval")
            built[name] = list(eval(code, {"__builtins__": {}, **names}))  # noqa: S307 - our own setup.py
    return built


def test_every_source_sits_in_a_folder_of_the_python_layout() -> None:
    stray = [p for p in _sources() if Path(p).relative_to("genie/csrc").parts[0] not in FOLDERS]
    assert not stray, f"genie/csrc files outside device/, server/, wire/: {stray}"


def test_every_cpp_is_built_by_exactly_one_extension_with_one_bindings_file() -> None:
    built = _built()
    assert set(built) == {"genie._C", "genie._C_plans", "genie._C_keys"}
    listed = [src for sources in built.values() for src in sources]
    cpp = [p for p in _sources() if p.endswith(".cpp")]
    assert sorted(listed) == sorted(cpp), "a .cpp that no extension builds, or one built twice"
    for name, sources in built.items():
        modules = [s for s in sources if "PYBIND11_MODULE" in (ROOT / s).read_text()
                   or "PyInit_" in (ROOT / s).read_text()]
        assert len(modules) == 1, f"{name}: one bindings file expected, found {modules}"


def test_the_architecture_layout_names_every_source() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text[text.index("## Layout"):]
    missing = [p for p in _sources()
               if p not in layout and str(Path(p).with_suffix("")) + ".h/.cpp" not in layout]
    assert not missing, f"docs/architecture.md's layout does not name: {missing}"
