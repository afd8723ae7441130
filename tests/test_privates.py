"""No module of genie.server reaches into another's private names.

A private name (``_x``) defined in one genie.server module (a module-level function or class, an attribute
``self._x``, an attrs field ``_x``) is that module's own business: another module that reads
``something._x`` or imports ``_x`` from it depends on internals the owner may change without notice (plans
and transfers read 21 of the executor's and the store's before the server core had an explicit API). This
test reads the sources (nothing is imported) and fails on each such access, naming the file, the line and
the owner. torch's own private names (``op._schema``, ``torch._C``) are not genie's and are not flagged.

The C++ in genie/csrc binds to Python through explicit public names only (the server's native runner through
genie.server.runner_api, the client's lane through NodeConnection's ``lane_*`` methods): a second check scans
its sources for a private name (``_x``, not a dunder) read, written or looked up by string, torch's included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "genie" / "server"
CSRC = Path(__file__).resolve().parents[1] / "genie" / "csrc"
#: A Python name looked up from C++ by a string: pybind11's attr/hasattr/getattr/setattr, the C API's
#: *AttrString and interned strings (for PyObject_GetAttr and method calls). The name's first character decides.
_CPP_LOOKUP = re.compile(r'\b(?:attr|hasattr|getattr|setattr|\w*AttrString|\w*FromString)\s*\('
                         r'(?:[^()"]|\([^()]*\))*?"(_(?!_)\w*)"')


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: module-level functions, classes and assignments, methods, class
    attributes and fields, and attributes assigned on ``self``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and _private(target.id):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self" and _private(target.attr):
                    names.add(target.attr)
    return names


def _modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(SERVER.parents[1])): ast.parse(path.read_text(), str(path))
            for path in sorted(SERVER.rglob("*.py"))}


def _violations(modules: dict[str, ast.Module]) -> list[str]:
    owners: dict[str, set[str]] = {}
    for path, tree in modules.items():
        for name in _defined(tree):
            owners.setdefault(name, set()).add(path)
    found = []
    for path, tree in modules.items():
        own = _defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in owners \
                    and node.attr not in own:
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                found.append(f"{path}:{node.lineno}: .{node.attr} belongs to {', '.join(sorted(owners[node.attr]))}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("genie.server"):
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{path}:{node.lineno}: imports {alias.name} from {node.module}")
    return found


def test_no_server_module_reads_another_modules_private_names() -> None:
    found = _violations(_modules())
    assert not found, "private names used outside their module (add a public method or name instead):\n" + \
        "\n".join(found)


def test_the_private_name_check_finds_a_read_of_another_modules_private() -> None:
    # The check itself: a store private read from another module, and a private import, are found.
    owner = ast.parse("class Store:\n    def __init__(self):\n        self._bytes = 0\n")
    reader = ast.parse("from genie.server.store import _hidden\n\ndef f(store):\n    return store._bytes\n")
    own_use = ast.parse("class A:\n    def __init__(self):\n        self._n = 0\n\ndef g(a):\n    return a._n\n")
    found = _violations({"genie/server/store.py": owner, "genie/server/plans.py": reader,
                         "genie/server/own.py": own_use})
    assert sorted(found) == ["genie/server/plans.py:1: imports _hidden from genie.server.store",
                             "genie/server/plans.py:4: ._bytes belongs to genie/server/store.py"]


def _cpp_violations(sources: dict[str, str]) -> list[str]:
    found = []
    for path, text in sources.items():
        for match in _CPP_LOOKUP.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path}:{line}: looks up the private name {match.group(1)}")
    return found


def _cpp_sources() -> dict[str, str]:
    return {str(path.relative_to(CSRC.parents[1])): path.read_text()
            for path in sorted(CSRC.rglob("*")) if path.suffix in (".cpp", ".h")}


def test_no_cpp_source_looks_up_a_private_python_name() -> None:
    sources = _cpp_sources()
    assert any(path.endswith("server/runner_binding.cpp") for path in sources)  # the scan reads the binding
    found = _cpp_violations(sources)
    assert not found, "C++ reads Python private names (bind to a public, documented name instead: " \
        "genie/server/runner_api.py for the native runner):\n" + "\n".join(found)


def test_the_cpp_check_finds_private_lookups_and_passes_public_and_dunder_ones() -> None:
    text = ('py::object a = store.attr("_storages");\n'
            'PyObject_SetAttrString(store.ptr(), "_bytes", now);\n'
            'static PyObject* m = PyUnicode_InternFromString("_ok");\n'
            'auto k = kernel.attr("_schema").attr("name");\n'
            'py::object b = tally.attr("counts"); py::object c = obj.attr("__name__");\n'
            'bool h = py::hasattr(metrics, "record_op");\n')
    assert _cpp_violations({"x.cpp": text}) == [
        "x.cpp:1: looks up the private name _storages", "x.cpp:2: looks up the private name _bytes",
        "x.cpp:3: looks up the private name _ok", "x.cpp:4: looks up the private name _schema"]
