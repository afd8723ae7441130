"""Discovery cost with every installed plugin: cold (cache cleared) and warm, against the targets.

    .venv/bin/python benchmarks/bench_discovery.py [--rounds 5] [--master HOST:PORT]

Cold: the capability cache (memory and disk) and the EAL memo are cleared first, so
the DPDK probe starts a real EAL in a subprocess and the RDMA probe runs pyverbs in
another. Warm: the same discovery again, host capabilities from the cache (only
peer-dependent probes such as TCP's run). Prints figures and ratios; asserts nothing.
The cache directory is a temporary one, so the user's cache is left alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

COLD_TARGET_MS = 300.0
WARM_TARGET_MS = 20.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--master", default="", help="HOST:PORT to probe against (TCP RTT)")
    args = parser.parse_args()
    os.environ["GENIE_CACHE_DIR"] = tempfile.mkdtemp(prefix="genie-bench-cache-")

    from genie.cli.discover import parse_master
    from genie.plugins import PluginManager
    from genie.transport.base import ProbeTarget
    from genie.transport.cache import get_capability_cache
    from genie.transport.discovery import discover_sync

    host, port = parse_master(args.master)
    target = ProbeTarget(host=host, port=port, timeout=2.0)
    t = time.perf_counter()
    pm = PluginManager()
    transports = pm.transports()
    load_ms = (time.perf_counter() - t) * 1000
    print(f"transports: {', '.join(sorted(transports))} (plugin manager built in {load_ms:.1f} ms)")

    def forget_memos() -> None:
        for mod in ("genie_dpdk.eal",):
            module = sys.modules.get(mod)
            if module is not None:
                module.forget_report()

    cold, warm = [], []
    last = None
    for _ in range(args.rounds):
        get_capability_cache().clear()
        forget_memos()
        found = discover_sync(pm, target)
        cold.append(found.elapsed * 1000)
        found = discover_sync(pm, target)
        warm.append(found.elapsed * 1000)
        last = found
    assert last is not None

    def line(label: str, values: list[float], target_ms: float) -> str:
        med = statistics.median(values)
        return (f"{label}: median {med:7.1f} ms  min {min(values):7.1f}  max {max(values):7.1f}  "
                f"target <= {target_ms:g} ms  ({med / target_ms:.2f}x of target)")

    print(line("cold discovery", cold, COLD_TARGET_MS))
    print(line("warm discovery", warm, WARM_TARGET_MS))
    print(f"cold / warm: {statistics.median(cold) / statistics.median(warm):.1f}x")
    for name, result in last.results.items():
        extra = ""
        if "eal_init_ms" in result.details:
            extra = f" (rte_eal_init {result.details['eal_init_ms']} ms)"
        print(f"  {name:12s} {result.reason_code:16s} {'cached' if name in last.cached else 'probed'}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
