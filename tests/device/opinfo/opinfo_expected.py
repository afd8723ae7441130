"""The expected-failure list (expected_failures.toml) and the pass-rate report.

The list is one TOML array of inline tables, one line per case, sorted, each with the reason the
case fails (the first line of its error when it was regenerated)::

    failures = [
      {op = "acosh", variant = "", dtype = "float32", kind = "forward", reason = "AttributeError: ..."},
    ]

Keys are (op, variant, dtype, kind). Regenerating (``--update-expected``) rewrites the entries of
the cases that ran and keeps the others, so a CI-subset run never drops the full sweep's entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomllib
from opinfo_cases import GATES, KINDS, Case

_DTYPE_ORDER = ("float32", "float64", "float16", "bfloat16", "int64", "bool", "complex64")
EXPECTED_PATH = Path(__file__).resolve().parent / "expected_failures.toml"
Key = tuple[str, str, str, str]

_HEADER = """\
# OpInfo cases (tests/device/opinfo) known to fail on remote_accelerator, one per line, with the reason.
# Key: (op, variant, dtype, kind). An unlisted failure fails the run; so does a listed case that passes
# (the list is stale). Regenerate after changing the device:
#   GENIE_OPINFO=full .venv/bin/python -m pytest -q tests/device/opinfo --update-expected
# Reasons are each error's first line; edit them into better ones where you know the cause.
"""


def load(path: Path = EXPECTED_PATH) -> dict[Key, str]:
    """The list as {key: reason}; a clear error naming the file for a malformed entry."""
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    entries: dict[Key, str] = {}
    for i, item in enumerate(data.get("failures", [])):
        try:
            case = Case(op=item["op"], variant=item["variant"], dtype=item["dtype"], kind=item["kind"])
            reason = item["reason"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: entry {i} needs op, variant, dtype, kind and reason ({exc}); "
                             "fix it or regenerate the file with --update-expected") from exc
        if case.kind not in KINDS:
            raise ValueError(f"{path}: entry {i} has kind {case.kind!r}; use one of {', '.join(KINDS)}")
        if not str(reason).strip():
            raise ValueError(f"{path}: entry {i} ({case.test_id}) has no reason; say why it fails")
        entries[case.key] = str(reason)
    return entries


def _toml_string(text: str) -> str:
    # JSON's string escapes are valid TOML basic-string escapes (ensure_ascii keeps it to \\uXXXX).
    return json.dumps(text)


def dump(entries: Mapping[Key, str]) -> str:
    lines = [_HEADER, "failures = ["]
    for (op, variant, dtype, kind), reason in sorted(entries.items()):
        lines.append(f"  {{op = {_toml_string(op)}, variant = {_toml_string(variant)}, dtype = {_toml_string(dtype)}, "
                     f"kind = {_toml_string(kind)}, reason = {_toml_string(reason)}}},")
    lines.append("]")
    return "\n".join(lines) + "\n"


def updated(old: Mapping[Key, str], results: Mapping[Case, Mapping[str, Any]]) -> dict[Key, str]:
    """``old`` with every case in ``results`` replaced by what it did now (listed only if it failed)."""
    ran = {c.key for c in results}
    new = {key: reason for key, reason in old.items() if key not in ran}
    for case, result in results.items():
        if result["status"] == "fail":
            new[case.key] = result.get("reason") or "failed (no reason given)"
    return new


def save(entries: Mapping[Key, str], path: Path = EXPECTED_PATH) -> None:
    path.write_text(dump(entries), encoding="utf-8")


def pass_rates(results: Mapping[Case, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (gate, kind, dtype), in report order: passed, failed, skipped, denied (every sample refused
    by a deny-list op), and the rate over passed + failed."""
    groups = sorted({(c.gate, c.kind, c.dtype) for c in results},
                    key=lambda g: (GATES.index(g[0]) if g[0] in GATES else len(GATES), KINDS.index(g[1]),
                                   _DTYPE_ORDER.index(g[2]) if g[2] in _DTYPE_ORDER else len(_DTYPE_ORDER), g[2]))
    rows = []
    for gate, kind, dtype in groups:
        statuses = [r["status"] for c, r in results.items() if (c.gate, c.kind, c.dtype) == (gate, kind, dtype)]
        passed, failed = statuses.count("pass"), statuses.count("fail")
        total = passed + failed
        rows.append({"gate": gate, "kind": kind, "dtype": dtype, "passed": passed, "failed": failed,
                     "skipped": statuses.count("skip"), "denied": statuses.count("denied"), "total": total,
                     "rate": round(100.0 * passed / total, 1) if total else None})
    return rows


def summary_lines(mode: str, rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """``genie opinfo (full): forward float32 650/677 (96.0%), 3 skipped`` per row."""
    out = []
    for row in rows:
        rate = f"{row['rate']:.1f}%" if row["rate"] is not None else "n/a"
        skipped = f", {row['skipped']} skipped" if row["skipped"] else ""
        denied = f", {row['denied']} denied" if row.get("denied") else ""
        out.append(f"genie {row.get('gate', 'opinfo')} ({mode}): {row['kind']} {row['dtype']} {row['passed']}/"
                   f"{row['total']} ({rate}){skipped}{denied}")
    return out
