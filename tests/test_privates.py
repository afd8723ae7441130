"""No module of genie.server reaches into another's private names.

A private name (``_x``) defined in one genie.server module (a module-level function or class, an attribute
``self._x``, an attrs field ``_x``) is that module's own business: another module that reads
``something._x`` or imports ``_x`` from it depends on internals the owner may change without notice (plans
and transfers read 21 of the executor's and the store's before the server core had an explicit API). This
test reads the sources (nothing is imported) and fails on each such access, naming the file, the line and
the owner. torch's own private names (``op._schema``, ``torch._C``) are not genie's and are not flagged.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "genie" / "server"


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
