"""Process isolation's cost (issue 11): ``--isolation process`` against ``none``, in one run.

    .venv/bin/python benchmarks/bench_isolation.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/bench_isolation.py --quick

Starts two real ``python -m genie.server --devices cpu`` processes on loopback, one with
``--isolation process`` (a worker process per session, the default) and one with ``none``
(sessions in threads: the baseline), and measures from this process over the wire protocol,
alternating blocks between the two so that the machine's load falls on both alike:

- a tiny op and its ``.item()``: one BATCH (add + FETCH of one element), one round trip;
- 64 MiB up and down: an upload, then a FETCH of the same bytes;
- session start: connect, HELLO, WELCOME (with ``process``: the worker's fork from the zygote).

Prints each figure with its ratio to ``none`` and a closing table; the target is within 10 %
for the data path. Asserts nothing; every child is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as c  # noqa: E402

BULK_BYTES = 64 << 20
TARGET_RATIO = 1.10
MODES = ("process", "none")


def start_server(kids: c.Children, mode: str) -> int:
    proc = kids.start([sys.executable, "-m", "genie.server", "--port", "0", "--devices", "cpu",
                       "--isolation", mode])
    line = c.read_line(proc, 120, lambda text: text.startswith("genie data plane listening"), "ready line")
    return int(line.split()[5].rsplit(":", 1)[1])


def tiny(client: Any, samples: int) -> list[float]:
    import torch

    from tests.raw_client import T, desc, fetch, op

    x = torch.ones(1)
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        client.send_batch([op("aten::add.Tensor", [T(1, x), T(1, x)], {}, [desc(2, x)]),
                           fetch(client.next_req(), desc(2, x))])
        client.reply()
        out.append(time.perf_counter() - t0)
    return out


def bulk(client: Any, data: Any) -> float:
    t0 = time.perf_counter()
    client.send_batch([], uploads=[(3, 0, data)])
    got = client.fetch(3, data)
    elapsed = time.perf_counter() - t0
    assert got.numel() == data.numel()
    return elapsed


def session_start(port: int) -> float:
    from tests.raw_client import RawClient

    t0 = time.perf_counter()
    with RawClient(port) as client:
        client.handshake()
        elapsed = time.perf_counter() - t0
        client.goodbye()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    args = parser.parse_args()
    blocks, samples = (4, 100) if args.quick else (10, 300)
    import torch

    from tests.raw_client import RawClient

    load = c.MachineLoad()
    data = torch.ones(BULK_BYTES, dtype=torch.uint8)
    figures: dict[str, dict[str, list[float]]] = {m: {"tiny": [], "bulk": [], "start": []} for m in MODES}
    with c.Children() as kids:
        ports = {mode: start_server(kids, mode) for mode in MODES}
        clients = {mode: RawClient(ports[mode], timeout=60) for mode in MODES}
        for client in clients.values():
            client.handshake()
            client.send_batch([], uploads=[(1, 0, torch.ones(1))])
            tiny(client, 50)  # warm up both paths
        for block in range(blocks):
            for mode in MODES if block % 2 == 0 else reversed(MODES):
                figures[mode]["tiny"] += tiny(clients[mode], samples)
                figures[mode]["bulk"].append(bulk(clients[mode], data))
                figures[mode]["start"] += [session_start(ports[mode]) for _ in range(3)]
        for client in clients.values():
            client.close()
    table = c.Table()
    for name, what, target in (("tiny", "tiny op + .item()", TARGET_RATIO), ("bulk", "64 MiB up + down", TARGET_RATIO),
                               ("start", "session start", None)):
        mine, base = (statistics.median(figures[m][name]) for m in MODES)
        ratio = mine / base
        value = c.fmt_ms(mine) if name != "tiny" else c.fmt_us(mine)
        baseline = c.fmt_ms(base) if name != "tiny" else c.fmt_us(base)
        print(f"{what}: process {value}, none {baseline}, ratio {ratio:.2f}")
        table.add(f"{what} (median)", value, f"{baseline} (none)", f"{ratio:.2f}",
                  f"<= {target:.2f}" if target else "-", ratio <= target if target else None)
    table.print("process isolation against isolation none")
    print(load.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
