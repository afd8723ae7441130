"""What metrics cost per op: a node with metrics on against one with them off, in the same run.

Two nodes on loopback, one client:

- the master runs with ``GENIE_ENABLE_TELEMETRY=false`` (its executor records nothing):
  ``remote_accelerator:0`` is the baseline;
- a worker runs with metrics on and ``--metrics-port`` (scraped once per block, as Prometheus
  would): ``remote_accelerator:1``.

Each block queues ``--ops`` tiny in-place ops (``x.add_(1)`` on 16 floats) on one device and ends
with one sync point; µs per op is the block's time over its ops. Blocks alternate between the two
devices so both see the same machine. The micro figure is the recording call alone
(``SessionMetrics.record_op`` against the no-op recorder), in process.

    .venv/bin/python benchmarks/bench_metrics.py [--ops 2000] [--blocks 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MachineLoad, Table, fmt_us, free_port  # noqa: E402


def micro(n: int = 200_000) -> tuple[float, float]:
    """Seconds per record_op call: recording on, and the no-op recorder (metrics off)."""
    from genie.server.metrics import NULL_SESSION_METRICS, ServerMetrics

    class Source:
        client: dict[str, str] = {"node_id": "bench"}
        serving = True
        store = None

    on = ServerMetrics().open_session(1, Source())
    out = []
    for recorder in (on, NULL_SESSION_METRICS):
        record = recorder.record_op
        t = time.perf_counter()
        for _ in range(n):
            started = time.perf_counter()
            record("aten::add_.Tensor", "ok", time.perf_counter() - started)
        out.append((time.perf_counter() - t) / n)
    return out[0], out[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="ops per block (default 2000)")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per device (default 10)")
    args = parser.parse_args()
    load = MachineLoad()

    import torch

    import genie
    from genie.cluster.launch import NodeProcess

    quiet = ("--heartbeat-interval", "1", "--gpu-poll-interval", "5")
    mport = free_port()  # --metrics-port 0 means off
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", *quiet,
                     env={"GENIE_ENABLE_TELEMETRY": "false"}) as master, \
            NodeProcess("worker", "--master", f"127.0.0.1:{master.control_port}", "--devices", "cpu",
                        "--metrics-port", str(mport), *quiet):
        genie.init_sync(master_addr="127.0.0.1", master_port=master.control_port, timeout=30)
        try:
            xs = {d: torch.zeros(16, device=f"remote_accelerator:{d}") for d in (0, 1)}
            per_op: dict[int, list[float]] = {0: [], 1: []}
            for block in range(args.blocks + 1):
                for d in (0, 1) if block % 2 else (1, 0):
                    x = xs[d]
                    t = time.perf_counter()
                    for _ in range(args.ops):
                        x.add_(1)
                    x.sum().item()
                    if block:  # the first round warms both up
                        per_op[d].append((time.perf_counter() - t) / args.ops)
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
                    scraped = r.read().decode()
            assert "genie_server_ops_total" in scraped
        finally:
            genie.shutdown_sync()
    off, on = statistics.median(per_op[0]), statistics.median(per_op[1])
    rec_on, rec_off = micro()
    table = Table()
    table.add("us per op, metrics on (end to end)", fmt_us(on), fmt_us(off) + " (metrics off)", f"{on / off:.3f}x",
              "< 1.05x", on / off < 1.05)
    table.add("record_op call", fmt_us(rec_on), fmt_us(rec_off) + " (no-op recorder)",
              f"+{(rec_on - rec_off) * 1e6:.2f} us", "< 2 us added", rec_on - rec_off < 2e-6)
    table.print(f"metrics overhead ({args.blocks} blocks of {args.ops} ops per device, medians)")
    print(load.report())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GENIE_LOG_LEVEL", "WARNING")
    raise SystemExit(main())
