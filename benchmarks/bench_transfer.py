"""Bulk transfers and the weight cache against raw sockets and torch.distributed.rpc, in one run.

    .venv/bin/python benchmarks/bench_transfer.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/bench_transfer.py --no-rpc   # skip the rpc baseline

Starts a real ``genie serve --devices cpu`` on loopback. Figures, each with its baseline from
the same run:

- **64 MiB up + down**: ``x.to(dev)`` + synchronize, then ``.cpu()``, in rounds interleaved with a
  raw blocking-socket echo of the same bytes (bench_remote.py's echo server: one reused buffer on
  each side), and torch.distributed.rpc sending the tensor there and back (TensorPipe, ``uv``).
- **Weight cache**: ``model.to(dev)`` of a 64 MiB model in a new session whose node already holds
  the weights, against the first upload of it (a miss: hashed, sent, kept) and against an upload
  with the cache off (``upload_cache="off"``: what every upload cost before).
- **Hash rates** of SHA-256 and BLAKE2b over 64 MiB (why the keys are SHA-256).

Like bench_remote, the run re-executes itself in a private network namespace for rpc's sake.
Asserts nothing; exits non-zero only if something crashes. Every child is stopped on exit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402
import bench_remote as br  # noqa: E402

BULK_BYTES = br.BULK_BYTES
TARGET_BULK_VS_RAW = 0.9
TARGET_BULK_VS_RPC = 2.0
MODEL_LAYERS = 16  # 16 Linear(1024, 1024): 64 MiB of weights, 64 KiB of biases


def _hash_rates() -> dict[str, float]:
    data = os.urandom(BULK_BYTES)
    out = {}
    for name in ("sha256", "blake2b"):
        best = min(_timed(lambda n=name: hashlib.new(n, data).digest()) for _ in range(3))
        out[name] = BULK_BYTES / best
    return out


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(MODEL_LAYERS)])


def _model_to(port: int, policy: str) -> float:
    """Seconds for ``model.to(dev)`` + synchronize in a new session (``upload_cache=policy``)."""
    import torch

    import genie

    genie.init_sync(master_addr="127.0.0.1", master_port=port, upload_cache=policy)
    try:
        model = _model()
        t0 = time.perf_counter()
        model.to("remote_accelerator:0")
        torch.remote_accelerator.synchronize()  # type: ignore[attr-defined]  # added by genie
        return time.perf_counter() - t0
    finally:
        genie.shutdown_sync()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-rpc", action="store_true", help="skip the torch.distributed.rpc baseline")
    parser.add_argument("--no-netns", action="store_true", help="run in place, not in a private network namespace")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--bulk-only", action="store_true", help="skip the weight cache (runs against older genie)")
    args = parser.parse_args()
    if not args.no_rpc:
        c.enter_private_netns()
    with c.sigterm_raises(), c.Children() as kids:
        return run(kids, args)


def run(kids: c.Children, args: argparse.Namespace) -> int:
    import torch

    import genie
    from genie.cluster.launch import NodeProcess

    print(f"bench_transfer: torch {torch.__version__}, {os.cpu_count()} CPUs")
    table = c.Table()
    load = c.MachineLoad()
    rates = _hash_rates()
    print(f"hash rates over 64 MiB: sha256 {c.fmt_rate(rates['sha256'])}, blake2b {c.fmt_rate(rates['blake2b'])} "
          f"(sha256 {rates['sha256'] / rates['blake2b']:.2f}x blake2b)")
    echo = kids.start([sys.executable, br.__file__, "--role", "echo"])
    raw = br.RawPeer(c.read_json_line(echo, 30)["port"])
    try:
        rpc_rate = 0.0
        if not args.no_rpc:
            rpc = br.measure_rpc(kids, 200)
            rpc_rate = 2 * BULK_BYTES / rpc["bulk_median"]
            print(f"rpc_sync 64 MiB there and back: {c.fmt_ms(rpc['bulk_median'])} = {c.fmt_rate(rpc_rate)}  (baseline)")
        with NodeProcess("serve", "--port", "0", "--devices", "cpu") as server:
            c.quiet(server)
            port = server.control_port
            genie.init_sync(master_addr="127.0.0.1", master_port=port)
            try:
                g = br.bulk_rounds(raw, args.rounds, reused=True)
            finally:
                genie.shutdown_sync()
            if not args.bulk_only:
                off = [_model_to(port, "off") for _ in range(2)]
                first = _model_to(port, "params")  # a miss: hashed, sent, kept by the node
                hits = [_model_to(port, "params") for _ in range(2)]
    finally:
        raw.close()
        kids.stop(echo)

    total = statistics.median([u + d for u, d in zip(g["up"], g["down"], strict=True)])
    raw_s = statistics.median(g["raw"])
    grate, raw_rate = 2 * BULK_BYTES / total, 2 * BULK_BYTES / raw_s
    up, down = statistics.median(g["up"]), statistics.median(g["down"])
    print(f"raw TCP 64 MiB up + down (interleaved): {c.fmt_ms(raw_s)} = {c.fmt_rate(raw_rate)}  (baseline)")
    print(f"genie 64 MiB upload {c.fmt_ms(up)} ({c.fmt_rate(BULK_BYTES / up)}), download {c.fmt_ms(down)} "
          f"({c.fmt_rate(BULK_BYTES / down)}), together {c.fmt_rate(grate)}"
          f"{'' if g['ok'] else '  (CONTENT MISMATCH)'}: {grate / raw_rate:.2f}x raw TCP"
          + (f", {grate / rpc_rate:.2f}x rpc" if rpc_rate else ""))
    table.add("64 MiB up+down", c.fmt_rate(grate), f"raw TCP {c.fmt_rate(raw_rate)}", f"{grate / raw_rate:.2f}x",
              f">= {TARGET_BULK_VS_RAW:g}x", grate / raw_rate >= TARGET_BULK_VS_RAW)
    into = statistics.median([u + d for u, d in zip(g["up"], g["down_into"], strict=True)])
    irate = 2 * BULK_BYTES / into
    print(f"genie 64 MiB upload + download into a reused tensor (buf.copy_(remote)): {c.fmt_rate(irate)} = "
          f"{irate / raw_rate:.2f}x raw TCP (the raw echo reuses its buffers too)")
    table.add("64 MiB up+down, reused dst", c.fmt_rate(irate), f"raw TCP {c.fmt_rate(raw_rate)}",
              f"{irate / raw_rate:.2f}x", f">= {TARGET_BULK_VS_RAW:g}x", irate / raw_rate >= TARGET_BULK_VS_RAW)
    if rpc_rate:
        table.add("64 MiB up+down", c.fmt_rate(grate), f"rpc {c.fmt_rate(rpc_rate)}", f"{grate / rpc_rate:.2f}x",
                  f">= {TARGET_BULK_VS_RPC:g}x", grate / rpc_rate >= TARGET_BULK_VS_RPC)

    if args.bulk_only:
        print(load.report())
        table.print("bench_transfer summary")
        return 0
    hit, plain = statistics.median(hits), statistics.median(off)
    print(f"model.to(dev), 64 MiB of weights, new session: cache off {c.fmt_ms(plain)} (baseline); first upload "
          f"(miss: hash + send + keep) {c.fmt_ms(first)} = {first / plain:.2f}x; already on the node (hit) "
          f"{c.fmt_ms(hit)} = {hit / plain:.2f}x of cache off, {hit / first:.2f}x of the first upload")
    table.add("model.to, weights cached", c.fmt_ms(hit), f"cache off {c.fmt_ms(plain)}", f"{hit / plain:.2f}x",
              "report", None)
    table.add("model.to, first upload", c.fmt_ms(first), f"cache off {c.fmt_ms(plain)}", f"{first / plain:.2f}x",
              "report", None)
    print(load.report())
    table.print("bench_transfer summary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
