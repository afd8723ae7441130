"""The first op after ``genie.init`` in a fresh process, before and after the start-up work of issue 16.

    .venv/bin/python benchmarks/bench_first_op.py            # about a minute on 2 loaded cores
    .venv/bin/python benchmarks/bench_first_op.py --runs 5

A ``genie serve --devices cpu`` runs on loopback. Each run starts three fresh processes, interleaved
so machine load hits all alike, each timing ``genie.init_sync`` and then the first op
(``torch.ones(4)``, ``+ 1``, ``.sum().item()``) with the modules it imported:

- local: the same op on CPU, no genie init (the baseline);
- before: genie with the start-up work switched off in the child (the first Python meta kernel
  imports ``torch._dynamo`` and, for type promotion, ``sympy``; nothing is warmed during init);
- after: genie as it is (dynamo's import deferred, sympy warmed on a thread during init).

Prints medians and the ratio to the baseline. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, genie
mode, port = sys.argv[1], int(sys.argv[2])
if mode == "before":
    import genie.device.meta as meta
    meta._dynamo_deferred = True  # torch's own behaviour: the first disable wrapper imports dynamo
    meta.warm_first_op = lambda: None
t1 = time.perf_counter()
if mode != "local":
    genie.init_sync(master_addr="127.0.0.1", master_port=port, timeout=60)
t2 = time.perf_counter()
n = len(sys.modules)
x = torch.ones(4, device="cpu" if mode == "local" else "remote_accelerator:0")
(x + 1).sum().item()
t3 = time.perf_counter()
print(json.dumps({"init": t2 - t1, "first": t3 - t2, "modules": len(sys.modules) - n,
                  "dynamo": "torch._dynamo" in sys.modules}))
if mode != "local":
    genie.shutdown_sync()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from genie.cluster.launch import NodeProcess

    load = c.MachineLoad()
    results: dict[str, list[dict[str, float]]] = {"local": [], "before": [], "after": []}
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--isolation", "none") as server:
        c.quiet(server)
        for _ in range(args.runs):
            for mode in results:
                out = subprocess.run([sys.executable, "-c", CHILD, mode, str(server.control_port)], capture_output=True,
                                     text=True, timeout=300)
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                if not lines:
                    print(f"{mode}: failed\n{out.stderr[-2000:]}")
                    return 1
                results[mode].append(json.loads(lines[-1]))
    local = statistics.median(r["first"] for r in results["local"])
    print(f"first op (ones, add, sum, item) in a fresh process, median of {args.runs}:")
    print(f"  local CPU: {local * 1e3:.1f} ms  (baseline)")
    for mode in ("before", "after"):
        rs = results[mode]
        first = statistics.median(r["first"] for r in rs)
        init = statistics.median(r["init"] for r in rs)
        modules = statistics.median(r["modules"] for r in rs)
        dynamo = sum(bool(r["dynamo"]) for r in rs)
        print(f"  {mode}: init {init * 1e3:.0f} ms, first op {first * 1e3:.0f} ms = {first / local:.0f}x local, "
              f"init + first op {(init + first) * 1e3:.0f} ms; {modules:.0f} modules imported by the first op, "
              f"dynamo imported in {dynamo} of {len(rs)}")
    print(load.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
