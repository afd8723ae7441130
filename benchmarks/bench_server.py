"""The server's cost per op beyond the kernel, for pipelined tiny ops on the raw wire (issue 10).

    .venv/bin/python benchmarks/bench_server.py            # about 20 s on 2 cores
    .venv/bin/python benchmarks/bench_server.py --ops 5000 --rounds 3

Starts a real ``genie serve --devices cpu`` on loopback and drives it with the raw
wire client of the tests (tests/raw_client.py), the way the device client pipelines
``y = y + 1``: each op reads the previous output's storage and writes a fresh one,
and frees the storage before, all fire-and-forget, then one SYNC. Every batch is
encoded before the clock starts, so the time is the server's (decode, descriptor
checks, tensor building, the kernel, the output rule, frees) plus the socket.

Baseline, measured in the same run: the same aten kernel called directly in this
process on a tensor of the same size. Prints both, and the server's overhead per
op (total minus kernel), and what the op allow-list and the pre-flight
(genie/server/preflight.py, a cache hit for a repeated op) cost alone, per op, in
this process (the full path's cost: a repeated op runs by its command plan,
genie/server/plans.py, which skips them). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from genie.testing import serve_subprocess  # noqa: E402
from tests.raw_client import RawClient, T, free, op  # noqa: E402

BATCH = 512


def encode_chain(first_id: int, n: int) -> list[list[bytes]]:
    """Batches of ``y = y + 1`` ops; each batch ends with one FREE of the storages its ops left behind,
    as the device client appends the frees it drained at the end of the batch it flushes."""
    y = torch.empty(1)
    batches = []
    for start in range(0, n, BATCH):
        ids = range(first_id + start, first_id + min(n, start + BATCH))
        # Outputs as tensor tags, as the device client sends them (genie/device/dispatch.py): a repeated op
        # then differs only in storage ids and runs by its command plan (genie/server/plans.py).
        cmds = [op("aten::add.Tensor", [T(src, y), 1], {}, [T(src + 1, y)]) for src in ids]
        batches.append([*cmds, free(*ids)])
    return batches


def kernel_seconds(n: int) -> tuple[float, float]:
    """The bare kernel, n times, in this process (grad mode off, as on the server): (wall, thread CPU)."""
    y = torch.zeros(1)
    add = torch.ops.aten.add.Tensor
    with torch.no_grad():
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            y = add(y, 1)
        return time.perf_counter() - t0, time.thread_time() - c0


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants: with process isolation a session runs in a worker process forked from
    the node's zygote, not in the node's process."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        found.append(p)
        stack.extend(children.get(p, ()))
    return found


def cpu_seconds(pid: int) -> float:
    """CPU time every thread of process ``pid`` and of its descendants has run so far
    (``/proc/PID/task/*/schedstat``, ns).

    On a machine other processes load, wall time per op measures the load as much as the server;
    the server's own CPU time per op does not."""
    total = 0
    for proc in _tree(pid):
        try:
            tids = os.listdir(f"/proc/{proc}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        for tid in tids:
            try:
                with open(f"/proc/{proc}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that ended meanwhile
    return total / 1e9


def preflight_seconds(n: int) -> float:
    """The per-op checks issue 11 added (allow-listed resolve, pre-flight with its cache hit), n times, in this
    process, on the arguments the server sees for ``y + 1``: the share of the server's overhead they cost."""
    from genie.server import preflight
    from genie.server.ops import resolve_op

    y = torch.zeros(1)
    args: list = [y, 1]
    t0 = time.perf_counter()
    for _ in range(n):
        add = resolve_op("aten::add.Tensor")
        preflight.check(add, "aten::add.Tensor", args, {}, max_elements=preflight.DEFAULT_MAX_OP_ELEMENTS,
                        remaining_bytes=1 << 30)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = args.ops
    with serve_subprocess("--port", "0", "--devices", "cpu", log_level="WARNING") as server, \
            RawClient(server.port, timeout=120) as c:
        c.handshake()
        totals, cpus = [], []
        next_id = 1
        for _ in range(args.rounds):
            c.send_batch([], uploads=[(next_id, 0, torch.zeros(1))])
            c.sync()
            batches = encode_chain(next_id, n)
            t0, c0 = time.perf_counter(), cpu_seconds(server.pid)
            for cmds in batches:
                c.send_batch(cmds)
            r = c.sync()
            totals.append(time.perf_counter() - t0)
            cpus.append(cpu_seconds(server.pid) - c0)
            assert r.error is None and r.deferred == [], r
            last = next_id + n
            assert c.fetch(last, torch.empty(1)).item() == float(n), "wrong result"
            c.send_batch([free(last)])
            next_id = last + 1
    kernels = [kernel_seconds(n) for _ in range(args.rounds)]
    checks = [preflight_seconds(n) for _ in range(args.rounds)]
    check_us = statistics.median(checks) / n * 1e6
    total_us = statistics.median(totals) / n * 1e6
    kernel_us = statistics.median(k[0] for k in kernels) / n * 1e6
    cpu_us = statistics.median(cpus) / n * 1e6
    kernel_cpu_us = statistics.median(k[1] for k in kernels) / n * 1e6
    print(f"pipelined tiny ops (aten::add.Tensor on 1 float, {n:,} ops x {args.rounds} rounds, batches of {BATCH}):")
    print(f"  server, end to end:      {total_us:6.2f} us/op  ({1e6 / total_us:,.0f} ops/s)")
    print(f"  bare kernel (baseline):  {kernel_us:6.2f} us/op")
    print(f"  server beyond the kernel: {total_us - kernel_us:5.2f} us/op  ({total_us / kernel_us:.1f}x the kernel)")
    print(f"  server CPU (all threads): {cpu_us:5.2f} us/op vs the kernel's CPU {kernel_cpu_us:5.2f} us/op (baseline): "
          f"{cpu_us - kernel_cpu_us:5.2f} us/op beyond the kernel ({cpu_us / kernel_cpu_us:.1f}x)")
    print(f"  load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"  allow-list + pre-flight (cache hit), alone: {check_us:5.2f} us/op: the full path's, which a command "
          "plan skips (genie/server/plans.py)")


if __name__ == "__main__":
    main()
