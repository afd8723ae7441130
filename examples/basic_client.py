"""Connect to a genie master, multiply matrices on remote_accelerator:0 and compare with the CPU.

Run it against a running server (``genie serve`` or ``examples/gpu_server.py``)::

    .venv/bin/python examples/basic_client.py --master 127.0.0.1:5555
    .venv/bin/python examples/basic_client.py --master gpu-server:5555 --size 2048 --repeat 5

Without ``--master`` it uses GENIE_MASTER_ADDR / GENIE_MASTER_PORT (default
127.0.0.1:5555). Prints where the device lives, both results' difference and both
timings; exits 1 if the results disagree, 2 if the master cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

import genie
from genie.errors import ConnectError, InitTimeoutError


def timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float]:
    """The result of ``fn()`` and its best time over ``repeat`` runs (at least one), in milliseconds."""
    t0 = time.perf_counter()
    out = fn()
    best = (time.perf_counter() - t0) * 1000
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, (time.perf_counter() - t0) * 1000)
    return out, best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default=None, help="HOST:PORT of the master (default: GENIE_MASTER_*)")
    parser.add_argument("--size", type=int, default=512, help="matrix size N of the N x N matmul (default 512)")
    parser.add_argument("--repeat", type=int, default=3, help="runs to time, best counts (default 3)")
    parser.add_argument("--device", type=int, default=0, help="N of remote_accelerator:N (default 0)")
    args = parser.parse_args(argv)

    master_addr: str | None = None
    master_port: int | None = None
    if args.master:
        host, _, port = args.master.rpartition(":")
        master_addr, master_port = host or "127.0.0.1", int(port)
    try:
        state = genie.init_sync(master_addr=master_addr, master_port=master_port, timeout=20)
    except (ConnectError, InitTimeoutError) as exc:
        print(f"basic_client: {exc}", file=sys.stderr)
        return 2
    try:
        device = f"remote_accelerator:{args.device}"
        if not 0 <= args.device < len(state.devices):
            print(f"basic_client: the cluster has {len(state.devices)} device(s); no {device}", file=sys.stderr)
            return 2
        entry = state.devices[args.device]
        print(f"connected: {len(state.devices)} device(s) on {len(state.nodes)} node(s), backend {state.backend}; "
              f"{device} is {entry['name']} ({entry['kind']}) on node {entry['node_id']}")
        torch.manual_seed(0)
        a, b = torch.randn(args.size, args.size), torch.randn(args.size, args.size)
        ra, rb = a.to(device), b.to(device)
        remote, remote_ms = timed(lambda: (ra @ rb).cpu(), args.repeat)  # .cpu() waits for the result
        local, local_ms = timed(lambda: a @ b, args.repeat)
        diff = (remote - local).abs().max().item()
        same = torch.allclose(remote, local, rtol=1e-3, atol=1e-3 * args.size ** 0.5)
        print(f"matmul {args.size}x{args.size}: max |remote - cpu| = {diff:.2e} -> {'match' if same else 'MISMATCH'}")
        print(f"time (best of {args.repeat}): remote {remote_ms:.1f} ms (incl. download), cpu {local_ms:.1f} ms, "
              f"ratio {remote_ms / local_ms:.2f}x")
        return 0 if same else 1
    finally:
        genie.shutdown_sync()


if __name__ == "__main__":
    sys.exit(main())
