"""genie across a slow link: ms per step and round trips per step at several round-trip times.

A remote GPU is rarely on loopback. This benchmark puts genie.testing's LinkEmulator in front of
a real node's control and data ports (the node advertises the emulator's ports, as a node behind
NAT would) and runs real models built from configs (random weights, no downloads) at each RTT:

- a nanoGPT-style training step (2 causal transformer layers, AdamW), ``loss.item()`` each step;
- HF GPT-2 training steps (no attention mask given), with the batch on the device and with a fresh
  CPU batch uploaded each step;
- HF BERT training step (sequence classification, no attention mask given);
- HF GPT-2 eval forward + ``logits.cpu()``;
- HF GPT-2 greedy ``generate``, per new token;
- a "5 s outage" row: a training loop whose data link goes down for 5 s at step 10 resumes
  (docs/network.md, Resume) and ends with the same final loss as without the outage; the batches the
  client sent equal those the node's session received (0 lost, 0 run twice). ``--outage-only`` runs it alone.

For each workload it prints the median ms/step at every RTT, the round trips per step (from
``genie.stats()``) and, against the target ``step(RTT) <= step(0) + 1.1 * RTT`` (per token for
generate), the excess in round trips: ``(step(RTT) - step(0)) / RTT``. Where round trips remain, the
lines of code that caused them (the sync-point table) are printed, so each one can be traced.

    .venv/bin/python benchmarks/bench_wan.py                 # RTT 0, 2 and 30 ms
    .venv/bin/python benchmarks/bench_wan.py --rtt 0,30 --steps 5 --json out.json
    .venv/bin/python benchmarks/bench_wan.py --compression-only   # weights over 100 Mbit/s, off vs auto

The node computes on the CPU of this machine; client and node share it, so absolute step times
are this machine's, and the ratios are what to compare between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from genie.cluster.launch import NodeProcess  # noqa: E402
from genie.testing import LinkEmulator  # noqa: E402

#: Runs in a fresh client process per RTT: prints one JSON line per workload.
CLIENT = r'''
import json, statistics, sys, time
import torch, genie
from genie.device.stats import diff

steps, warmup = int(sys.argv[1]), int(sys.argv[2])
genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[3]), timeout=60)
dev = "remote_accelerator:0"
torch.manual_seed(0)

def measure(name, make, step, per=1):
    state = make()
    for _ in range(warmup):
        step(state)
    before = genie.stats()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(state)
        walls.append((time.perf_counter() - t0) / per)
    d = diff(genie.stats(), before)
    print(json.dumps({"name": name, "ms": statistics.median(walls) * 1e3,
                      "trips": d["round_trips"] / (steps * per),
                      "lines": [[p["line"], p["reason"], p["count"] / steps] for p in d["sync_points"][:4]]}),
          flush=True)

from torch import nn
class Block(nn.Module):
    def __init__(s, d=64, h=4, t=32):
        super().__init__()
        s.attn = nn.MultiheadAttention(d, h, batch_first=True); s.mlp = nn.Sequential(nn.Linear(d, 4*d), nn.GELU(), nn.Linear(4*d, d))
        s.l1, s.l2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.register_buffer("mask", torch.triu(torch.full((t, t), float("-inf")), 1))
    def forward(s, x):
        h = s.l1(x); x = x + s.attn(h, h, h, attn_mask=s.mask, need_weights=False)[0]
        return x + s.mlp(s.l2(x))
class NanoGPT(nn.Module):
    def __init__(s, v=256, d=64, t=32):
        super().__init__(); s.tok = nn.Embedding(v, d); s.pos = nn.Embedding(t, d)
        s.blocks = nn.Sequential(Block(d), Block(d)); s.head = nn.Linear(d, v)
    def forward(s, idx, targets):
        x = s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device))
        logits = s.head(s.blocks(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

def nano():
    m = NanoGPT().to(dev); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (8, 32)).to(dev)
    return m, opt, idx
def nano_step(s):
    m, opt, idx = s
    opt.zero_grad(set_to_none=True); loss = m(idx, idx); loss.backward(); opt.step(); loss.item()
measure("nanoGPT train step, loss.item()", nano, nano_step)

from transformers import GPT2Config, GPT2LMHeadModel, BertConfig, BertForSequenceClassification
from transformers.utils import logging as hf_logging
hf_logging.set_verbosity_error()
gcfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2)
def gpt2(fresh=False):
    def make():
        m = GPT2LMHeadModel(gcfg).to(dev); opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        ids = torch.randint(0, 512, (4, 32))
        return m, opt, ids if fresh else ids.to(dev)
    def step(s):
        m, opt, ids = s
        ids = ids.to(dev)
        opt.zero_grad(set_to_none=True); loss = m(input_ids=ids, labels=ids).loss; loss.backward(); opt.step(); loss.item()
    return make, step
measure("HF GPT-2 train step (batch on device)", *gpt2())
measure("HF GPT-2 train step (fresh CPU batch)", *gpt2(fresh=True))

bcfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                  max_position_embeddings=64)
def bert():
    m = BertForSequenceClassification(bcfg).to(dev); opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    return m, opt, torch.randint(0, 512, (4, 32)).to(dev), torch.randint(0, 2, (4,)).to(dev)
def bert_step(s):
    m, opt, ids, y = s
    opt.zero_grad(set_to_none=True); loss = m(input_ids=ids, labels=y).loss; loss.backward(); opt.step(); loss.item()
measure("HF BERT train step", bert, bert_step)

def gen_model():
    m = GPT2LMHeadModel(gcfg).to(dev).eval()
    return m, torch.randint(0, 512, (1, 8)).to(dev)
def evalfwd(s):
    m, ids = s
    with torch.no_grad():
        m(input_ids=ids).logits.cpu()
measure("HF GPT-2 eval forward + logits.cpu()", gen_model, evalfwd)
NEW = 8
def generate(s):
    m, ids = s
    with torch.no_grad():
        m.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
measure("HF GPT-2 greedy generate (per token)", gen_model, generate, per=NEW)
genie.shutdown_sync()
'''


def run_at(rtt_ms: float, steps: int, warmup: int) -> list[dict[str, Any]]:
    """One node behind two emulated links (control and data), one client process; the workloads' results."""
    delay = rtt_ms / 2e3
    with LinkEmulator(("127.0.0.1", 1), delay=delay) as control, LinkEmulator(("127.0.0.1", 1), delay=delay) as data:
        env = {"GENIE_BACKEND": "tcp", "GENIE_LOG_LEVEL": "WARNING"}
        with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--advertise-ports", str(data.port),
                         env=env, ready_timeout=120) as node:
            control.target = ("127.0.0.1", node.control_port)
            data.target = ("127.0.0.1", node.data_port)
            done = subprocess.run([sys.executable, "-c", CLIENT, str(steps), str(warmup), str(control.port)],
                                  capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, **env})
    if done.returncode != 0:
        raise SystemExit(f"client at RTT {rtt_ms} ms failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


#: A training loop run twice in one client: as it is, then through a 5 s outage of the data link at step 10.
OUTAGE_CLIENT = r'''
import json, sys, torch, genie
from genie.device.registry import table
genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=60)
dev = "remote_accelerator:0"
conn = table().connections()[0]

def loop(outage_at=None):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.TransformerEncoder(layer, 2),
                                torch.nn.Linear(64, 256)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (8, 33))
    x, y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
    for step in range(30):
        if step == outage_at:
            print("OUTAGE", flush=True)
            sys.stdin.readline()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        value = loss.item()
    return value

plain = loop()
through = loop(outage_at=10)
state = conn.resumable
genie.shutdown_sync()
print(json.dumps({"plain": plain, "through": through, "sent": state.log.sent if state else None,
                  "resumes": state.resumes if state else 0}), flush=True)
'''


def outage_row(seconds: float = 5.0) -> dict[str, Any]:
    """A training loop through a ``seconds`` outage of the data link (resume, genie.device.resume): its final
    loss against the same loop without the outage, and the batches the client sent against those the node's
    session received (from the node's log line when the session closed): equal means 0 lost, 0 run twice."""
    import re

    with LinkEmulator(("127.0.0.1", 1), delay=0.001) as data:
        env = {"GENIE_BACKEND": "tcp", "GENIE_LOG_LEVEL": "WARNING"}
        # INFO: the session's closing line (batches received, resumes) is what the node's side is read from
        with NodeProcess("--log-level", "INFO", "serve", "--port", "0", "--devices", "cpu", "--advertise-ports",
                         str(data.port), env=env, ready_timeout=120) as node:
            data.target = ("127.0.0.1", node.data_port)
            client = subprocess.Popen([sys.executable, "-c", OUTAGE_CLIENT, str(node.control_port)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, **env})
            assert client.stdin is not None and client.stdout is not None
            started = 0.0
            for line in client.stdout:
                if line.startswith("OUTAGE"):
                    data.down(seconds)
                    started = time.perf_counter()
                    client.stdin.write("go\n")
                    client.stdin.flush()
                elif line.startswith("{"):
                    result = json.loads(line)
                    break
            else:
                raise SystemExit(f"the outage client failed (exit {client.wait(60)})")
            client.wait(60)
            wall = time.perf_counter() - started
            pattern = r"closed: freed \d+ storages, \d+ bytes; (\d+) batches received, (\d+) resumes"
            deadline = time.monotonic() + 30  # the worker's last log line reaches the node's log after GOODBYE
            while not (closed := re.findall(pattern, node.log())) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not closed:
                print("\n".join(line for line in node.log().splitlines() if "session" in line)[-3000:], file=sys.stderr)
    received = max((int(b) for b, r in closed if int(r) > 0), default=-1)
    return {**result, "received": received, "outage_s": seconds, "wall_s": wall}


def print_outage(row: dict[str, Any]) -> None:
    same = row["plain"] == row["through"]
    lost_or_twice = row["sent"] - row["received"] if row["sent"] is not None else None
    print(f"\n{row['outage_s']:g} s outage | final loss {row['through']:.6f} vs {row['plain']:.6f} without "
          f"({'same' if same else 'DIFFERENT'}) | batches sent {row['sent']}, received by the node {row['received']} "
          f"({'0 lost, 0 run twice' if lost_or_twice == 0 else 'MISMATCH'}) | resumes {row['resumes']} | "
          f"loop from the outage on took {row['wall_s']:.1f} s")


#: Uploads a GPT-2's weights (random init, from a config) once and prints the seconds until the node has them.
UPLOAD_CLIENT = r"""
import json, sys, time, torch, genie
from transformers import GPT2Config, GPT2LMHeadModel
from genie.device.registry import table
genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=60)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256))
nbytes = sum(p.nbytes for p in model.parameters())
started = time.perf_counter()
model.to("remote_accelerator:0")
next(model.parameters()).sum().item()  # a sync point: every upload before it has been applied
seconds = time.perf_counter() - started
conn = table().connections()[0]
print(json.dumps({"mode": conn.compression_policy.mode, "bytes": nbytes, "seconds": seconds,
                  "wire": conn.stats["bytes_packed_wire"], "packed": conn.stats["bytes_packed"],
                  "reason": conn.compression.reason}), flush=True)
genie.shutdown_sync()
"""


def compression_row(mbit: float = 100.0) -> list[dict[str, Any]]:
    """Effective upload throughput of a model's weights (a GPT-2 of 4 layers, 256 wide: 68 MB in fp32) over a
    data link capped at ``mbit`` Mbit/s (LinkEmulator ``rate=``), with ``compression=off`` and then ``auto``
    (which measures the link and compresses below compression_below_mbit), one client process each, one node."""
    rows = []
    with LinkEmulator(("127.0.0.1", 1), rate=mbit * 1e6 / 8) as data:
        env = {"GENIE_BACKEND": "tcp", "GENIE_LOG_LEVEL": "WARNING", "GENIE_UPLOAD_CACHE": "off"}
        with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--advertise-ports", str(data.port),
                         env=env, ready_timeout=120) as node:
            data.target = ("127.0.0.1", node.data_port)
            for mode in ("off", "auto"):
                done = subprocess.run([sys.executable, "-c", UPLOAD_CLIENT, str(node.control_port)],
                                      capture_output=True, text=True, timeout=600,
                                      env={**os.environ, **env, "GENIE_COMPRESSION": mode})
                if done.returncode != 0:
                    raise SystemExit(f"the upload client ({mode}) failed:\n{done.stderr[-4000:]}")
                rows.append(json.loads(done.stdout.splitlines()[-1]))
    return [{**row, "mbit": mbit} for row in rows]


def print_compression(rows: list[dict[str, Any]]) -> None:
    off, auto = rows
    mb = off["bytes"] / 1e6
    share = auto["wire"] / auto["packed"] if auto["packed"] else 1.0
    print(f"\nupload of a GPT-2's weights ({mb:.0f} MB) at {off['mbit']:g} Mbit/s | compression off "
          f"{mb / off['seconds']:.1f} MB/s ({off['seconds']:.1f} s) | auto {mb / auto['seconds']:.1f} MB/s "
          f"({auto['seconds']:.1f} s; {share:.3f} of the bytes on the wire) | {off['seconds'] / auto['seconds']:.2f}x"
          f"\n  auto chose: {auto['reason']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt", default="0,2,30", help="round-trip times in ms, comma-separated (first is the baseline)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--compression-only", action="store_true", help="only the compression row")
    parser.add_argument("--outage-only", action="store_true", help="only the 5 s outage row (resume)")
    parser.add_argument("--latency-only", action="store_true", help="only the latency table (no outage, compression)")
    args = parser.parse_args()
    if args.compression_only:
        print_compression(compression_row())
        return 0
    if args.outage_only:
        print_outage(outage_row())
        return 0
    rtts = [float(r) for r in args.rtt.split(",")]
    results: dict[float, list[dict[str, Any]]] = {}
    for rtt in rtts:
        started = time.perf_counter()
        results[rtt] = run_at(rtt, args.steps, args.warmup)
        print(f"# RTT {rtt:g} ms done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    base = rtts[0]
    header = ["workload", "trips/step"] + [f"ms @ {r:g}" for r in rtts] + \
             [f"excess RTTs @ {r:g}" for r in rtts[1:]]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for i, row in enumerate(results[base]):
        cells = [row["name"], "/".join(f"{results[r][i]['trips']:.2f}" for r in rtts)]
        cells += [f"{results[r][i]['ms']:.1f}" for r in rtts]
        for r in rtts[1:]:
            excess = (results[r][i]["ms"] - row["ms"]) / r
            cells.append(f"{excess:.2f} ({'met' if excess <= 1.1 else 'missed'})")
        print(" | ".join(cells))
    worst = rtts[-1]
    print(f"\nsync points at RTT {worst:g} ms (line, reason, per step):")
    for row in results[worst]:
        for line, reason, count in row["lines"]:
            print(f"  {row['name']}: {count:.2f} x {reason} at {line}")
    print(textwrap.dedent("""
        target: step(RTT) <= step(0) + 1.1 RTT (the issue's bound); 'excess RTTs' is (step(RTT) - step(0)) / RTT."""))
    if not args.latency_only:
        outage = outage_row()
        print_outage(outage)
        print_compression(compression_row())
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
