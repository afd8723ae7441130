"""Start a DPDK EAL in this (short-lived) process and report what it sees, as one JSON object.

Run by :func:`genie_dpdk.eal.eal_report` as ``python -I _eal_probe.py '<json request>'``;
never imported by genie itself. DPDK allows one EAL per process and ``rte_eal_init``
changes the process for good (threads, CPU affinity, signal handling), so it only
ever runs here. The script needs nothing but the standard library and cffi (ABI
mode: no compiler, no DPDK headers), so it starts fast.

The request: ``{"libs": {"eal": path, "ethdev": path, "gpudev": path or null},
"eal_args": [...]}``. The report, written to the original stdout (DPDK's own log
goes to stderr): ``{"stage": ..., "rc": ..., "errno": ..., "error": ...,
"ports": [...], "gpus": n or null, "version": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CDEF = """
int rte_eal_init(int argc, char **argv);
int rte_eal_cleanup(void);
const char *rte_strerror(int errnum);
const char *rte_version(void);
extern int per_lcore__rte_errno;
"""
CDEF_ETHDEV = """
uint16_t rte_eth_dev_count_avail(void);
uint16_t rte_eth_find_next(uint16_t port_id);
int rte_eth_dev_get_name_by_port(uint16_t port_id, char *name);
"""
CDEF_GPUDEV = "int16_t rte_gpu_count_avail(void);"
RTE_MAX_ETHPORTS = 32
RTE_ETH_NAME_MAX_LEN = 64


def probe(request: dict[str, Any]) -> dict[str, Any]:
    """Load the libraries, run ``rte_eal_init``, count ports and GPUs."""
    report: dict[str, Any] = {"stage": "import", "rc": None, "errno": None, "error": None,
                              "ports": [], "gpus": None, "version": None}
    started = time.perf_counter()
    try:
        import cffi
    except ImportError as exc:
        report["error"] = f"cffi is not installed ({exc}); pip install cffi"
        return report
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.cdef(CDEF_ETHDEV)
    ffi.cdef(CDEF_GPUDEV)
    libs = request["libs"]
    report["stage"] = "load"
    try:
        # RTLD_GLOBAL: the drivers EAL loads later resolve their symbols against these.
        eal = ffi.dlopen(libs["eal"], ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
        eth = ffi.dlopen(libs["ethdev"], ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
        gpu = ffi.dlopen(libs["gpudev"], ffi.RTLD_NOW | ffi.RTLD_GLOBAL) if libs.get("gpudev") else None
    except OSError as exc:
        report["error"] = str(exc)
        return report
    report["version"] = ffi.string(eal.rte_version()).decode(errors="replace")
    report["stage"] = "eal_init"
    args = ["genie-dpdk-probe", *request["eal_args"]]
    keep = [ffi.new("char[]", a.encode()) for a in args]
    argv = ffi.new("char *[]", keep)
    t0 = time.perf_counter()
    rc = eal.rte_eal_init(len(args), argv)
    report["eal_init_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    report["rc"] = rc
    if rc < 0:
        # rte_errno is thread-local; dlsym (which cffi uses) resolves it for this thread.
        err = eal.per_lcore__rte_errno
        report["errno"] = err
        report["error"] = ffi.string(eal.rte_strerror(err)).decode(errors="replace")
        return report
    report["stage"] = "query"
    name = ffi.new("char[]", RTE_ETH_NAME_MAX_LEN)
    port = eth.rte_eth_find_next(0)
    while port < RTE_MAX_ETHPORTS:
        eth.rte_eth_dev_get_name_by_port(port, name)
        report["ports"].append({"id": port, "name": ffi.string(name).decode(errors="replace")})
        port = eth.rte_eth_find_next(port + 1)
    report["port_count"] = int(eth.rte_eth_dev_count_avail())
    if gpu is not None:
        report["gpus"] = max(int(gpu.rte_gpu_count_avail()), 0)
    eal.rte_eal_cleanup()
    report["stage"] = "done"
    report["total_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return report


def main() -> int:
    # DPDK logs to stdout; keep stdout for the report and send everything else to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    request = json.loads(sys.argv[1])
    try:
        report = probe(request)
    except Exception as exc:  # reported, not raised: the parent turns it into a reason
        report = {"stage": "crash", "error": f"{type(exc).__name__}: {exc}"}
    out.write(json.dumps(report) + "\n")
    out.flush()
    # Skip interpreter teardown: EAL threads are still alive and need no goodbye.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
