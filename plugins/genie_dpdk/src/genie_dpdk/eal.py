"""Finding DPDK and asking a short-lived EAL what it sees (shared with genie-gpudev).

:func:`eal_report` runs ``_eal_probe.py`` in a subprocess, because DPDK allows one
EAL per process and ``rte_eal_init`` changes the process for good. The subprocess
starts with ``--no-huge --no-pci --no-shconf`` and one virtual ``net_null`` port, on
the first CPU this process may use, with a unique ``--file-prefix``; it is killed
(with its process group) if it outlives its timeout, always reaped, and its runtime
directory (``/var/run/dpdk/<prefix>`` for root) is removed afterwards.

The report is kept in memory for a few seconds, so the ``dpdk`` and ``dpdk_gpudev``
probes of one discovery share one EAL start. Longer-lived caching is discovery's job
(see :func:`host_fingerprint`).

Environment: ``GENIE_DPDK_LIB_DIR`` (a directory searched first for the libraries),
``GENIE_DPDK_EAL_ARGS`` (replaces the default EAL arguments, e.g. ``-a 0000:3b:00.0 -l 2``
to probe a real NIC; ``--file-prefix`` is always added).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from genie.transport.cache import find_library_file, library_dirs, path_fingerprint

log = logging.getLogger("genie.plugins.dpdk")

ABI = "23"  # DPDK 22.11's ABI version
LIBRARIES = {
    "eal": (f"librte_eal.so.{ABI}", "librte_eal.so"),
    "ethdev": (f"librte_ethdev.so.{ABI}", "librte_ethdev.so"),
    "gpudev": (f"librte_gpudev.so.{ABI}", "librte_gpudev.so"),
}
PROBE_SCRIPT = Path(__file__).with_name("_eal_probe.py")
PREFIX_STEM = "genie-probe"
#: How long one EAL report serves later probes in this process.
MEMO_SECONDS = 5.0

_counter = itertools.count()


def find_libraries() -> dict[str, str | None]:
    """The path of each DPDK library genie uses, or None where it is not installed."""
    first = os.environ.get("GENIE_DPDK_LIB_DIR", "")
    found: dict[str, str | None] = {}
    for key, names in LIBRARIES.items():
        path = None
        if first:
            path = next((os.path.join(first, n) for n in names if os.path.exists(os.path.join(first, n))), None)
        found[key] = path or find_library_file(*names)
    return found


def pmd_dirs(libs: dict[str, str | None]) -> list[str]:
    """Directories EAL loads drivers from (next to librte_eal: ``dpdk/pmds-<abi>.0``)."""
    if not libs.get("eal"):
        return []
    return [os.path.join(os.path.dirname(str(libs["eal"])), "dpdk", f"pmds-{ABI}.0")]


def first_cpu() -> int:
    """The lowest CPU this process may run on (EAL's ``-l``)."""
    try:
        return min(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError):
        return 0


def default_eal_args() -> list[str]:
    """The EAL arguments of a probe (without ``--file-prefix``)."""
    custom = os.environ.get("GENIE_DPDK_EAL_ARGS", "").strip()
    if custom:
        return shlex.split(custom)
    return [
        "--no-huge", "--no-pci", "--no-shconf", "--no-telemetry",
        "-l", str(first_cpu()), "-m", "16",
        "--vdev", "net_null0",
        "--log-level=notice",
    ]


def host_fingerprint() -> dict[str, Any]:
    """What the EAL report depends on: library files, driver directory, arguments, CPUs."""
    libs = find_libraries()
    return {
        "libs": path_fingerprint(p for p in libs.values() if p),
        "missing": sorted(k for k, p in libs.items() if not p),
        "pmd_dirs": path_fingerprint(pmd_dirs(libs)),
        "eal_args": default_eal_args(),
        "lib_dir": os.environ.get("GENIE_DPDK_LIB_DIR", ""),
    }


@attrs.frozen
class EalReport:
    """What one EAL start found.

    ``stage`` is where it stopped: ``missing`` (no library file), ``import`` (no cffi),
    ``load`` (dlopen failed), ``eal_init`` (rte_eal_init failed), ``crash``, ``timeout``,
    or ``done``. ``log`` is the tail of DPDK's own output.
    """

    stage: str
    error: str = ""
    errno: int | None = None
    ports: tuple[str, ...] = ()
    gpus: int | None = None
    version: str = ""
    libs: dict[str, str | None] = attrs.field(factory=dict)
    log: str = ""
    elapsed_ms: float = 0.0
    eal_init_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.stage == "done"


def _runtime_base() -> Path:
    # Where EAL 22.11 puts its runtime directory (eal_create_runtime_dir).
    if os.geteuid() == 0:
        return Path("/var/run/dpdk")
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / "dpdk"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_runtime_dir(prefix: str, base_existed: bool) -> None:
    base = _runtime_base()
    shutil.rmtree(base / prefix, ignore_errors=True)
    # Leftovers of probes whose genie process died mid-probe: genie-probe-<pid>-<n>.
    try:
        for entry in base.iterdir():
            parts = entry.name.split("-")
            if entry.name.startswith(PREFIX_STEM + "-") and len(parts) == 4 and parts[2].isdigit():
                if not _pid_alive(int(parts[2])):
                    shutil.rmtree(entry, ignore_errors=True)
    except OSError:
        pass
    if not base_existed:
        try:
            base.rmdir()
        except OSError:
            pass  # not empty: someone else's DPDK lives there


def run_probe_process(argv: list[str], timeout: float) -> tuple[int | None, str, str, int]:
    """Run ``argv``, killing its process group after ``timeout`` s; returns (rc or None, stdout, stderr, pid).

    The child is always reaped before this returns.
    """
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, text=True, errors="replace",
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, proc.pid
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        out, err = proc.communicate()
        return None, out or "", err or "", proc.pid
    finally:
        if proc.poll() is None:  # interrupted (KeyboardInterrupt...): do not leave it behind
            proc.kill()
            proc.wait()


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])


def run_eal_probe(timeout: float) -> EalReport:
    """Start an EAL in a subprocess now (no memo) and report; never raises for DPDK trouble."""
    started = time.perf_counter()
    libs = find_libraries()
    if not libs["eal"] or not libs["ethdev"]:
        return EalReport("missing", libs=libs, error="no librte_eal/librte_ethdev in " + ", ".join(library_dirs()))
    prefix = f"{PREFIX_STEM}-{os.getpid()}-{next(_counter)}"
    request = {"libs": libs, "eal_args": [*default_eal_args(), "--file-prefix", prefix]}
    base_existed = _runtime_base().exists()
    try:
        rc, out, err, _pid = run_probe_process([sys.executable, "-I", str(PROBE_SCRIPT), json.dumps(request)], timeout)
    finally:
        _remove_runtime_dir(prefix, base_existed)
    elapsed = round((time.perf_counter() - started) * 1000, 1)
    if rc is None:
        return EalReport("timeout", error=f"the EAL probe process did not finish within {timeout:g} s and was killed",
                         libs=libs, log=_tail(err), elapsed_ms=elapsed)
    line = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        data = json.loads(line)
    except ValueError:
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        return EalReport("crash", error=f"the EAL probe process {how} without a report",
                         libs=libs, log=_tail(err), elapsed_ms=elapsed)
    stage = str(data.get("stage", "crash"))
    return EalReport(
        stage=stage,
        error=str(data.get("error") or ""),
        errno=data.get("errno"),
        ports=tuple(str(p["name"]) for p in data.get("ports", ())),
        gpus=data.get("gpus"),
        version=str(data.get("version") or ""),
        libs=libs,
        log=_tail(err),
        elapsed_ms=elapsed,
        eal_init_ms=data.get("eal_init_ms"),
    )


_memo_lock = threading.Lock()
_memo: tuple[float, str, EalReport] | None = None


def eal_report(timeout: float) -> EalReport:
    """:func:`run_eal_probe`, shared by every caller within :data:`MEMO_SECONDS` (blocking, thread-safe)."""
    global _memo
    key = json.dumps(host_fingerprint(), sort_keys=True)
    with _memo_lock:
        if _memo is not None and _memo[1] == key and time.monotonic() - _memo[0] < MEMO_SECONDS:
            return _memo[2]
        report = run_eal_probe(timeout)
        if report.stage != "timeout":
            _memo = (time.monotonic(), key, report)
        return report


def forget_report() -> None:
    """Drop the memo (tests)."""
    global _memo
    with _memo_lock:
        _memo = None
