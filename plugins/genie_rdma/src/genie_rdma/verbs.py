"""Finding pyverbs and running the verbs probe in a subprocess.

pyverbs comes from Debian's ``python3-pyverbs`` (the PyPI sdist does not build
without rdma-core's sources). It is a compiled extension for Debian's own Python,
and genie usually runs in a virtual environment that does not see
``/usr/lib/python3/dist-packages``. Rather than add that directory to ``sys.path``
(which would shadow the environment's packages with Debian's), the probe runs
``_verbs_probe.py`` in a subprocess with an interpreter that has pyverbs:

1. ``GENIE_PYVERBS_PYTHON`` if set;
2. this interpreter, if ``import pyverbs`` would work here (a system-site venv, a
   pip-installed pyverbs);
3. Debian's ``/usr/bin/python3``, if ``/usr/lib/python3/dist-packages/pyverbs`` exists.

A subprocess also keeps a misbehaving verbs provider (a hang, a crash) out of
the genie process. The subprocess is killed after its timeout and always reaped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs

from genie.transport.cache import find_library_file, listing_fingerprint, path_fingerprint

PROBE_SCRIPT = Path(__file__).with_name("_verbs_probe.py")
DEBIAN_PYTHON = "/usr/bin/python3"
DEBIAN_PYVERBS = "/usr/lib/python3/dist-packages/pyverbs"
SYSFS = "/sys/class/infiniband"


def find_interpreter() -> tuple[str | None, str]:
    """An interpreter that can import pyverbs, and where pyverbs is (None, what was tried) if none."""
    override = os.environ.get("GENIE_PYVERBS_PYTHON", "")
    if override:
        return override, f"GENIE_PYVERBS_PYTHON={override}"
    spec = importlib.util.find_spec("pyverbs")
    if spec is not None and spec.origin:
        return sys.executable, str(Path(spec.origin).parent)
    if os.path.isdir(DEBIAN_PYVERBS) and os.path.exists(DEBIAN_PYTHON):
        return DEBIAN_PYTHON, DEBIAN_PYVERBS
    return None, f"not importable by {sys.executable} and {DEBIAN_PYVERBS} absent"


def port_states() -> dict[str, str]:
    """``/sys/class/infiniband/<dev>/ports/<n>/state`` contents (cheap; part of the fingerprint)."""
    states: dict[str, str] = {}
    for dev in listing_fingerprint(SYSFS) or []:
        for port in listing_fingerprint(os.path.join(SYSFS, dev, "ports")) or []:
            try:
                states[f"{dev}/{port}"] = Path(SYSFS, dev, "ports", port, "state").read_text().strip()
            except OSError:
                states[f"{dev}/{port}"] = "unreadable"
    return states


def host_fingerprint() -> dict[str, Any]:
    """pyverbs' location, libibverbs, the RDMA device listing and port states."""
    interpreter, where = find_interpreter()
    return {
        "interpreter": interpreter,
        "pyverbs": path_fingerprint([os.path.join(where, "__init__.py")]) if interpreter else where,
        "libibverbs": path_fingerprint([find_library_file("libibverbs.so.1") or "libibverbs.so.1"]),
        "providers": listing_fingerprint("/etc/libibverbs.d"),
        "devices": listing_fingerprint(SYSFS),
        "ports": port_states(),
    }


@attrs.frozen
class VerbsReport:
    """What the verbs probe found. ``stage``: ``missing``, ``import``, ``list``, ``query``, ``done``,
    ``crash`` or ``timeout``."""

    stage: str
    error: str = ""
    devices: tuple[dict[str, Any], ...] = ()
    pyverbs: str = ""
    interpreter: str = ""


def verbs_report(timeout: float) -> VerbsReport:
    """Run the verbs probe in a subprocess (blocking); never raises for RDMA trouble."""
    interpreter, where = find_interpreter()
    if interpreter is None:
        return VerbsReport("missing", error=f"pyverbs not found ({where})")
    try:
        proc = subprocess.run(
            [interpreter, "-I", str(PROBE_SCRIPT)], stdin=subprocess.DEVNULL, capture_output=True,
            text=True, errors="replace", timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        # subprocess.run has killed and reaped the child.
        return VerbsReport("timeout", error=f"the verbs probe did not finish within {timeout:g} s and was killed",
                           interpreter=interpreter)
    except OSError as exc:
        return VerbsReport("missing", error=f"cannot run {interpreter}: {exc}", interpreter=interpreter)
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
        return VerbsReport("crash", error=f"the verbs probe exited with status {proc.returncode}: {tail}",
                           interpreter=interpreter)
    return VerbsReport(
        stage=str(data.get("stage")), error=str(data.get("error") or ""),
        devices=tuple(data.get("devices") or ()), pyverbs=str(data.get("pyverbs") or where),
        interpreter=interpreter,
    )
