"""The package's import graph, read from the source with ``ast``: no circles, and a lazy face.

Every import counts, at module level or inside a function (a lazy import is still an edge a
later change can turn into a circle); imports under ``if TYPE_CHECKING:`` do not (they never
run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import genie

PACKAGE = Path(genie.__file__).parent


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    # A compiled extension (genie._C) is known by its stub: `from genie import _C` imports it, not the face.
    for path in [*root.rglob("*.py"), *(p for p in root.rglob("*.pyi") if not p.with_suffix(".py").exists())]:
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its body except under ``if TYPE_CHECKING``."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    found.add(full)
                elif base in modules:
                    found.add(base)
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    found.discard(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the package modules it imports."""
    modules = _module_names(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def _chain(graph: dict[str, set[str]], circle: list[str]) -> str:
    """One concrete loop through ``circle``, for the failure message."""
    members = set(circle)
    path = [circle[0]]
    while True:
        nxt = sorted(graph[path[-1]] & members)
        step = next((n for n in nxt if n not in path), nxt[0])
        path.append(step)
        if step in path[:-1]:
            return " -> ".join(path[path.index(step):])


def test_the_genie_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the walker found too few modules; is it reading the package?"
    circles = import_circles(graph)
    assert not circles, "import circles (each a loop of imports; break it by moving the shared name down):\n" + \
        "\n".join(f"  {len(c)} modules: {_chain(graph, c)}" for c in circles)


def test_the_walker_finds_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
                              "from .sub import c\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def version():\n    from pkg import __version__\n    return __version__\n")
    (pkg / "b.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.c"}, "TYPE_CHECKING imports must not count; relative ones must"
    assert import_circles(graph) == [["pkg", "pkg.a", "pkg.sub.c"]]
    assert _chain(graph, ["pkg", "pkg.a", "pkg.sub.c"]) == "pkg -> pkg.a -> pkg.sub.c -> pkg"


def test_no_module_of_the_package_imports_the_package_face() -> None:
    graph = import_graph()
    importers = sorted(name for name, targets in graph.items() if "genie" in targets and name != "genie")
    assert not importers, f"these modules import genie/__init__.py (import from genie._version etc. instead): {importers}"


def test_importing_genie_errors_loads_neither_the_runtime_nor_torch() -> None:
    code = ("import sys, genie.errors, genie; "
            "print(sorted(m for m in ('torch', 'genie.api', 'genie.cluster.runtime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_lazy_face_resolves_every_public_name() -> None:
    import genie.api
    import genie.hookspecs

    for name in genie.__all__:
        assert getattr(genie, name) is not None
    assert genie.init_sync is genie.api.init_sync and genie.hookimpl is genie.hookspecs.hookimpl
    assert set(genie.__all__) <= set(dir(genie))
    try:
        genie.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("genie.no_such_name did not raise AttributeError")


def test_docs_architecture_md_names_every_module_of_the_package() -> None:
    layout = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        # a module is named by its path, or by its file name on a line of its package's other modules
        if rel not in layout and not any(path.name in line and f"{path.parent.relative_to(PACKAGE.parent).as_posix()}/"
                                         in line for line in layout.splitlines()):
            missing.append(rel)
    assert not missing, f"docs/architecture.md's layout does not name: {missing}"


_FIRST_IMPORTS = ["genie.wire.values", "genie.server", "torch"]


@pytest.mark.parametrize("first", _FIRST_IMPORTS)
def test_any_module_imported_first_leaves_torch_importable_and_the_device_registered(first: str) -> None:
    """torch's device-backend autoload (genie.autoload) runs inside whichever genie module imported torch first;
    that module may be half-made then (genie.wire.values once made `import torch` fail with "Failed to load the
    backend extension: genie"). Registration then waits for genie.device, and the device works either way."""
    code = (f"import {first}; import torch; import genie.device; "
            "print(torch._C._get_privateuse1_backend_name(), torch.device('remote_accelerator:1'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["remote_accelerator", "remote_accelerator:1"]


def _top_level_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, anywhere in its body except under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name.split(".")[0] for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module.split(".")[0])
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _declared_plugin_dependencies(pyproject: Path) -> set[str]:
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
    return {dep.split("=")[0].split(">")[0].split("<")[0].strip().replace("-", "_") for dep in deps}


def test_plugins_build_on_the_core_and_never_import_each_other() -> None:
    """A transport or monitor plugin imports genie (the core) and itself, never another plugin.

    What several backends share (the stream channel, the sniffing listener, the record layer) lives
    in ``genie.transport``; a site can install any subset of the plugins. The one exception is a
    plugin that extends another and declares it as a dependency (genie-gpudev is DPDK with GPU
    memory: it requires genie-dpdk).
    """
    plugins_dir = PACKAGE.parent / "plugins"
    sources = {p.name: p / "src" / p.name for p in plugins_dir.iterdir() if (p / "src" / p.name).is_dir()}
    assert {"genie_tcp", "genie_shm", "genie_rdma", "genie_dpdk"} <= set(sources)
    offending = []
    for name, src in sorted(sources.items()):
        for path in sorted(src.rglob("*.py")):
            declared = _declared_plugin_dependencies(src.parents[1] / "pyproject.toml")
            for other in sorted(_top_level_imports(path) & (set(sources) - {name} - declared)):
                offending.append(f"{path.relative_to(plugins_dir)} imports {other}")
    assert not offending, "plugins must build on genie's core, not on each other:\n" + "\n".join(offending)
