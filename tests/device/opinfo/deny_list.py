"""The completeness gates' one deny list (tests/device/deny_list.toml): ops the server refuses on purpose.

Every gate (OpInfo, ModuleInfo, optim_db, random ops, AMP) asks :func:`denied_by` about each error a
sample raises: a server refusal (``ForbiddenOpError``) of a listed op makes the sample "denied" (left out
of the comparison, counted in the report); any other refusal is the gate's failure.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

DENY_PATH = Path(__file__).resolve().parents[1] / "deny_list.toml"
#: "remote aten::x failed on the server: op 'aten::x' is not on ..." -> aten::x
_REFUSED = re.compile(r"remote ((?:aten|prims)::[\w.]+)")


def load(path: Path = DENY_PATH) -> dict[str, str]:
    """{op name: reason}; a clear error naming the file for a malformed entry."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    entries: dict[str, str] = {}
    for i, item in enumerate(data.get("denied", [])):
        op, reason = item.get("op"), str(item.get("reason", "")).strip()
        if not isinstance(op, str) or "::" not in op or not reason:
            raise ValueError(f"{path}: entry {i} needs op (aten::name) and a reason; fix the entry")
        if op in entries:
            raise ValueError(f"{path}: {op} is listed twice; keep one entry")
        entries[op] = reason
    return entries


def refused_op(exc: BaseException) -> str | None:
    """The op a server refusal names, or None when ``exc`` is not a refusal."""
    from genie.errors import ForbiddenOpError

    if not isinstance(exc, ForbiddenOpError):
        return None
    found = _REFUSED.search(str(exc))
    return found.group(1) if found else "?"


def denied_by(exc: BaseException, entries: dict[str, str]) -> str | None:
    """The deny-list entry that covers ``exc`` (the refused op's name), or None."""
    op = refused_op(exc)
    if op is None:
        return None
    base = op.split(".")[0]
    return op if op in entries else base if base in entries else None
