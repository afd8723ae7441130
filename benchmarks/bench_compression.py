"""Compression of tensor bytes: what it saves on real payloads, and whether compress + send beats send.

Part 1, ratios: a GPT-2 built from a transformers config (4 layers, 384 wide: 26M parameters), its
weights at random init and after three AdamW steps, its gradients, and activations (hidden states),
in fp32 and bf16; each compressed as genie does (bytes shuffled by element size, zstd level 1),
with plain zstd level 1 and with lz4 (when the ``lz4`` package is installed) beside it; the
compressed share of the bytes (lower is better) and compression and decompression speed on this
machine, one thread.

Part 2, links: a real node behind genie.testing's LinkEmulator capped at 10, 100 and 1000 Mbit/s
(``rate=``), a real client session uploading a slice of those weights with compression off and with
zstd, in the same run: effective throughput (raw bytes over the time from the upload to the node's
answer to a sync) and the ratio.

    .venv/bin/python benchmarks/bench_compression.py
    .venv/bin/python benchmarks/bench_compression.py --rates 100 --seconds 2

Client and node share this machine's CPUs (and the emulator's threads), so at 1000 Mbit/s the
emulator itself may be the limit: each row prints the raw rate the link reached uncompressed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import zstandard  # noqa: E402

from genie.cluster.launch import NodeProcess  # noqa: E402
from genie.device.compression import CompressionPolicy  # noqa: E402
from genie.device.connection import NodeConnection  # noqa: E402
from genie.testing import LinkEmulator  # noqa: E402
from genie.wire import compress  # noqa: E402
from genie.wire.messages import hello_body  # noqa: E402
from genie.wire.values import dtype_code  # noqa: E402


def payloads() -> dict[str, torch.Tensor]:
    """Real tensors of a small GPT-2: weights (init, trained a little), gradients, activations; fp32 and bf16."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=384, n_head=6, n_positions=256)
    model = GPT2LMHeadModel(config)

    def flat(ts: Any) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in ts])

    init = flat(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (4, 128))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    out = model(ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    trained = flat(model.parameters())
    grads = flat(p.grad for p in model.parameters())
    acts = torch.cat([h.detach().reshape(-1) for h in out.hidden_states])
    return {"weights, random init (fp32)": init, "weights, 3 AdamW steps (fp32)": trained,
            "weights, 3 AdamW steps (bf16)": trained.bfloat16(), "gradients (fp32)": grads,
            "gradients (bf16)": grads.bfloat16(), "activations (fp32)": acts, "activations (bf16)": acts.bfloat16()}


def _speed(fn: Any, nbytes: int) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(2):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return out, nbytes / best / 1e6


def ratios(tensors: dict[str, torch.Tensor]) -> None:
    try:
        import lz4.frame as lz4
    except ImportError:
        lz4 = None
    print("payload | MB | genie (shuffle + zstd 1) | compress MB/s | decompress MB/s | zstd 1 | lz4")
    print("--- | --- | --- | --- | --- | --- | ---")
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8)
        nbytes = raw.numel()
        # one thread, as the speeds are compared: genie uses zstd's workers only from compress.THREADED_BYTES
        single = compress.THREADED_BYTES
        compress.THREADED_BYTES = 1 << 62
        try:
            packed, c_speed = _speed(lambda raw=raw, t=t: compress.pack(raw, t.element_size()), nbytes)
        finally:
            compress.THREADED_BYTES = single
        if packed is None:
            genie = "not sent compressed (saves < 3%)"
            d_speed = float("nan")
        else:
            data, packing = packed
            out = torch.empty(nbytes, dtype=torch.uint8)
            _, d_speed = _speed(lambda data=data, packing=packing, out=out: compress.unpack_into(data, packing, out,
                                                                                                 "bench"), nbytes)
            assert torch.equal(out, raw)
            genie = f"{len(data) / nbytes:.3f}"
        plain = len(zstandard.ZstdCompressor(level=1).compress(raw.numpy().tobytes())) / nbytes
        lz = f"{len(lz4.compress(raw.numpy().tobytes())) / nbytes:.3f}" if lz4 is not None else "(lz4 not installed)"
        print(f"{name} | {nbytes / 1e6:.1f} | {genie} | {c_speed:.0f} | {d_speed:.0f} | {plain:.3f} | {lz}",
              flush=True)


def _session(port: int, mode: str) -> NodeConnection:
    from genie_tcp import TcpTransport

    channel = TcpTransport().connect("127.0.0.1", port, timeout=10)
    channel.settimeout(120)
    conn = NodeConnection(channel, node_id="bench", address=f"127.0.0.1:{port}", op_timeout=600)
    conn.compression_policy = CompressionPolicy(mode, 1e9, 256 << 10)
    conn.handshake(hello_body(node_id="bench-client", role="client", backends=["tcp"]), 30)
    return conn


def upload_seconds(port: int, mode: str, t: torch.Tensor, repeats: int) -> tuple[float, NodeConnection]:
    """Best time of ``repeats`` uploads of ``t`` as a new storage, until the node answered a sync after it."""
    conn = _session(port, mode)
    best = float("inf")
    for i in range(repeats):
        started = time.perf_counter()
        conn.upload(100 + i, 0, t, overwrite=False)
        conn.sync()
        best = min(best, time.perf_counter() - started)
        if i:
            conn.frees.append(100 + i - 1)
    if mode != "off":  # the bytes came through intact
        back = conn.fetch(0, [100 + repeats - 1, dtype_code(t.dtype), list(t.shape), [1], 0, t.nbytes],
                          torch.empty_like(t))
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    return best, conn


def links(tensors: dict[str, torch.Tensor], rates: list[float], seconds: float, repeats: int) -> None:
    print("\nlink | payload | MB | off: MB/s (s) | zstd: MB/s (s) | wire share | zstd / off")
    print("--- | --- | --- | --- | --- | --- | ---")
    with NodeProcess.data_plane("--port", "0", "--devices", "cpu", "--log-level", "WARNING") as node:
        for mbit in rates:
            rate = mbit * 1e6 / 8
            with LinkEmulator(("127.0.0.1", node.port), rate=rate) as link:
                for name in ("weights, 3 AdamW steps (fp32)", "weights, 3 AdamW steps (bf16)"):
                    whole = tensors[name]
                    n = min(whole.numel(), int(rate * seconds) // whole.element_size())
                    t = whole[:n].clone()
                    off, c1 = upload_seconds(link.port, "off", t, repeats)
                    on, c2 = upload_seconds(link.port, "zstd", t, repeats)
                    share = c2.stats["bytes_packed_wire"] / max(1, c2.stats["bytes_packed"])
                    c1.close()
                    c2.close()
                    mb = t.nbytes / 1e6
                    print(f"{mbit:g} Mbit/s | {name} | {mb:.1f} | {mb / off:.1f} ({off:.2f}) | {mb / on:.1f} ({on:.2f}) "
                          f"| {share:.3f} | {off / on:.2f}x", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10,100,1000", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="raw transfer time each payload is sized for")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-ratios", action="store_true")
    args = parser.parse_args()
    tensors = payloads()
    if not args.skip_ratios:
        ratios(tensors)
    links(tensors, [float(r) for r in args.rates.split(",")], args.seconds, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
