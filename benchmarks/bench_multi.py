"""Many remote devices as one machine: each row measures genie against its anchor in the same run.

Rows are functions in :data:`ROWS`; each takes the shared :class:`Bench` (a loopback cluster of a
master and two worker nodes, started once) and returns its result map, printed as one JSON line.

Copies between devices (issue 32):

- ``peer_copy_64mib``: a 64 MiB copy between devices of two worker nodes (``y.copy_(x)``, node to node over
  tcp: genie.server.peer_copy) against a raw 64 MiB TCP send between two processes on the same loopback,
  with the client's own data-plane bytes per copy (the kernel's count on its sockets). Targets: rate at
  least 0.9 of the raw send's; the client's bytes at most 1 KiB. The raw send runs before and after the
  copies (a busy host drifts within a run): the ratio is against the mean of the two, and the row shows
  both, and the load average at its start. Beside it: the first copy of the session (cold), and what a
  copy costs beside its bytes: the median 4 KiB copy (call to the destination's sync answer) against a bare
  sync round trip to the destination.

torch.distributed rows (issue 32):

- ``all_reduce_64mib``: ``dist.all_reduce`` of 64 MiB (float32) between two client processes whose
  tensors live on ``remote_accelerator`` devices of two worker nodes (the data moves between the
  nodes' session workers over gloo), against gloo's all_reduce run directly between two processes
  on the same host. Target: genie's rate at least 0.8 of gloo's.
- ``ddp_step``: one DDP training step of a small transformer on two remote devices against the same
  DDP step on two local CPU processes (gloo); with one round trip to a node (``.item()``) measured
  beside it. Target: genie's step at most 1.2x the local one plus one round trip. Beside the times:
  the load average at the row's start, the CPU milliseconds per timed iteration of each kind of
  process (the clients; the nodes; their session workers), read from /proc between the first and the
  last timed iteration after every process of the benchmark went quiet, and genie's ops queued and
  round trips per iteration (``genie.stats()``; an iteration is the barrier, a sync, the step and one
  more round trip).
- ``ddp_step_1rank``: the same with one rank: genie's client and its session worker (two busy
  processes) against one local process. Two ranks of genie are four busy processes (two clients, two
  session workers) against the local run's two: on a 2-core host this row is the one that fits.
- ``ddp_step_buckets``: the two-rank step with 0.25 MB buckets (4 buckets instead of DDP's one for this
  model): how each bucket's all_reduce overlaps the rest of the backward pass, as in a large model.

The whole benchmark re-executes itself in a private network namespace with only loopback up
(``unshare -n``), as torch.distributed peers are started: ``--no-netns`` runs in place.

    python benchmarks/bench_multi.py [--rows peer_copy_64mib,all_reduce_64mib,ddp_step,ddp_step_1rank,ddp_step_buckets]
                                     [--iters 5] [--warmup 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Children, drain, emit, enter_private_netns, read_json_line  # noqa: E402

LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}

#: A client: with GENIE=1 its tensors live on the device of node NODE, else on the CPU. The process group
#: forms over the benchmark's store; BODY's timings come back as one RESULT line.
CLIENT = """
import datetime, json, os, statistics, time
import torch, torch.distributed as dist
rank, iters = int(os.environ["RANK"]), int(os.environ["ITERS"])
if os.environ["GENIE"] == "1":
    import genie, genie.distributed
    from genie.device.registry import table
    genie.init_sync(master_addr="127.0.0.1", master_port=int(os.environ["MASTER_CONTROL_PORT"]), timeout=60)
    remote = next(d for d in table().devices if d.node_id == os.environ["NODE"])
    device = torch.device("remote_accelerator", remote.index)
    torch.accelerator.set_device_index(remote.index)  # dist.barrier() runs on the current device
    backend = "cpu:gloo,remote_accelerator:genie"
else:
    device, backend = torch.device("cpu"), "gloo"
world = int(os.environ["WORLD"])
store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), world, is_master=False,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group(backend, rank=rank, world_size=world, store=store, timeout=datetime.timedelta(seconds=120))
def sync():
    if device.type != "cpu":
        torch.ones(1, device=device).sum().item()
def timed_window():
    # The benchmark reads every process's CPU time between "go" and each rank's "done" (Bench.pair).
    store.set(f"bench/ready/{rank}", "1")
    store.wait(["bench/go"])
    if device.type != "cpu":
        out["before"] = genie.stats()
def window_done():
    if device.type != "cpu":
        after = genie.stats()
        out.update({k + "_per_iter": (after[k] - out["before"][k]) / iters for k in ("ops_queued", "round_trips")})
        del out["before"]
    store.set(f"bench/done/{rank}", "1")
out = {}
"""

ALL_REDUCE = """
t = torch.ones(16 * 1024 * 1024, device=device) * (rank + 1)
times = []
for i in range(iters + 2):
    dist.barrier()
    started = time.perf_counter()
    dist.all_reduce(t)
    times.append(time.perf_counter() - started)
out["seconds"] = statistics.median(times[2:])
out["check"] = float(t[:1].cpu()[0])
"""

DDP_STEP = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True),
    torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True),
    torch.nn.Linear(128, 128)).to(device)
ddp = DDP(model, bucket_cap_mb=float(os.environ.get("BUCKET_MB", "25")))  # 25: DDP's default
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(8, 32, 128, generator=g).to(device), torch.randn(8, 32, 128, generator=g).to(device)
def step():
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
times, rtts = [], []
for i in range(iters + 2):
    if i == 2:
        timed_window()
    dist.barrier()
    sync()
    started = time.perf_counter()
    float(step())  # the step ends when its loss is known here, as a training loop's logging does
    times.append(time.perf_counter() - started)
    if device.type != "cpu":
        one = torch.ones(1, device=device)
        started = time.perf_counter()
        one.sum().item()
        rtts.append(time.perf_counter() - started)
window_done()
out["seconds"] = statistics.median(times[2:])
out["rtt"] = statistics.median(rtts) if rtts else 0.0
out["parameters"] = sum(p.numel() for p in model.parameters())
logged = ddp._get_ddp_logging_data()  # DDP rebuilds its buckets after the first step
out["buckets"] = len(str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", "")).split(","))
"""


class Bench:
    """What the rows share: the cluster (started on first use), the child processes, the iteration count."""

    def __init__(self, children: Children, iters: int, warmup: float = 5.0) -> None:
        self.children = children
        self.iters = iters
        self.warmup = warmup
        self._cluster: Any = None

    def cluster(self) -> Any:
        if self._cluster is None:
            from genie.testing import LocalCluster

            self._cluster = LocalCluster(("w1", "w2"), env=LOOPBACK).start()
        return self._cluster

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.stop()

    def pair(self, body: str, *, on_genie: bool, ranks: int = 2, **env: str) -> list[dict[str, Any]]:
        """Run ``body`` in ``ranks`` client processes (rank r on a remote device of node w<r+1>, or on the CPU).

        A body that calls ``timed_window()`` and ``window_done()`` gets the CPU time every process spent between
        the two (see :func:`cpu_by_process`) in rank 0's result, under ``"cpu_ms"`` (milliseconds per iteration).
        """
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        script = CLIENT + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out), flush=True)\n"
        env = {**LOOPBACK, **env, "GENIE": "1" if on_genie else "0", "ITERS": str(self.iters),
               "STORE_PORT": str(store.port), "WORLD": str(ranks)}
        if on_genie:
            env["MASTER_CONTROL_PORT"] = str(self.cluster().port)
        procs = [self.children.start([sys.executable, "-c", script],
                                     env={**env, "RANK": str(rank), "NODE": f"w{rank + 1}"})
                 for rank in range(ranks)]
        logs: list[list[str]] = [[] for _ in procs]
        for proc, log in zip(procs, logs, strict=True):
            drain(proc.stderr, log)
        try:
            cpu: dict[str, float] | None = None
            if "timed_window()" in body:
                cpu = self._window(store, procs)
            results = [read_json_line(proc, 600) for proc in procs]
            if cpu is not None:
                results[0]["cpu_ms"] = {role: round(seconds * 1e3 / self.iters, 2) for role, seconds in cpu.items()}
            return results
        except Exception:
            for rank, log in enumerate(logs):
                print(f"rank {rank}'s stderr:", *log[-30:], sep="\n", file=sys.stderr)
            raise
        finally:
            for proc in procs:
                self.children.stop(proc)


    def _window(self, store: Any, procs: list[Any]) -> dict[str, float]:
        """The CPU seconds each role spent while the clients ran their timed iterations (after every process of
        the benchmark went quiet: a node forks and imports its next spare session worker when a session starts)."""
        ranks = len(procs)
        store.wait([f"bench/ready/{r}" for r in range(ranks)], datetime.timedelta(seconds=300))
        roots = {p.pid: "clients" for p in procs}
        if self._cluster is not None:
            roots.update({node.proc.pid: "nodes" for node in self._cluster.nodes() if node.proc is not None})
        settle(roots)
        before = cpu_by_process(roots)
        store.set("bench/go", "1")
        store.wait([f"bench/done/{r}" for r in range(ranks)], datetime.timedelta(seconds=300))
        return cpu_by_role(before, cpu_by_process(roots))


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, user + system CPU seconds) of every process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # it ended meanwhile
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_by_process(roots: dict[int, str]) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of the processes under ``roots`` (pid -> role): a client and its children
    are ``clients``; a node process and its children (its forkserver, its resource tracker) ``nodes``; a node's
    grandchildren (its session workers, forked by its forkserver) ``session workers``."""
    procs = _processes()
    found: dict[int, tuple[str, float]] = {}
    for pid, (_parent, seconds) in procs.items():
        depth, up = 0, pid
        while up not in roots and up in procs and depth < 8:
            up, depth = procs[up][0], depth + 1
        if up in roots:
            found[pid] = ("session workers" if roots[up] == "nodes" and depth >= 2 else roots[up], seconds)
    return found


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by role between two :func:`cpu_by_process` snapshots (a process that ended in between is
    left out: a session of an earlier row ending; one started in between counts whole)."""
    totals: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        totals[role] = totals.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return totals


def settle(roots: dict[int, str], quiet: float = 0.05, deadline: float = 20.0) -> None:
    """Wait until the processes under ``roots`` together use under ``quiet`` of a CPU (at most ``deadline`` s)."""
    end = time.monotonic() + deadline
    last = cpu_by_process(roots)
    while time.monotonic() < end:
        time.sleep(0.5)  # not a test: a sampling interval
        now = cpu_by_process(roots)
        if sum(cpu_by_role(last, now).values()) < quiet * 0.5:
            return
        last = now


def all_reduce_64mib(bench: Bench) -> dict[str, Any]:
    """64 MiB all_reduce between two remote devices of two nodes against gloo between two local processes."""
    gloo = max(r["seconds"] for r in bench.pair(ALL_REDUCE, on_genie=False))
    remote = bench.pair(ALL_REDUCE, on_genie=True)
    genie_s = max(r["seconds"] for r in remote)
    assert all(r["check"] == 3.0 * 2 ** (bench.iters + 1) for r in remote), remote  # in place, iters + 2 times
    mib = 64
    return {"row": "all_reduce_64mib", "gloo_ms": round(gloo * 1e3, 1), "genie_ms": round(genie_s * 1e3, 1),
            "gloo_mib_s": round(mib / gloo), "genie_mib_s": round(mib / genie_s),
            "rate_ratio": round(gloo / genie_s, 2), "target": ">= 0.8"}


def _ddp(bench: Bench, name: str, ranks: int, bucket_mb: float = 25.0) -> dict[str, Any]:
    load = os.getloadavg()[0]
    local = bench.pair(DDP_STEP, on_genie=False, ranks=ranks, BUCKET_MB=str(bucket_mb))
    remote = bench.pair(DDP_STEP, on_genie=True, ranks=ranks, BUCKET_MB=str(bucket_mb))
    local_s = max(r["seconds"] for r in local)
    genie_s, rtt = max(r["seconds"] for r in remote), max(r["rtt"] for r in remote)
    return {"row": name, "ranks": ranks, "parameters": remote[0]["parameters"], "buckets": remote[0]["buckets"],
            "load_average": round(load, 1),
            "local_ms": round(local_s * 1e3, 1), "genie_ms": round(genie_s * 1e3, 1), "rtt_ms": round(rtt * 1e3, 2),
            "ratio": round(genie_s / local_s, 2), "ratio_less_rtt": round((genie_s - rtt) / local_s, 2),
            "local_cpu_ms_per_iter": local[0]["cpu_ms"], "genie_cpu_ms_per_iter": remote[0]["cpu_ms"],
            "genie_ops_per_iter": remote[0]["ops_queued_per_iter"],
            "genie_round_trips_per_iter": remote[0]["round_trips_per_iter"],
            "target": "<= 1.2 (less one round trip)"}


def ddp_step(bench: Bench) -> dict[str, Any]:
    """A DDP step of a small transformer on two remote devices against the same step on two local CPU processes."""
    return _ddp(bench, "ddp_step", 2)


def ddp_step_1rank(bench: Bench) -> dict[str, Any]:
    """The same DDP step with one rank: genie's client and its session worker (two busy processes) against one
    local process, which fits a 2-core host where two ranks' four busy processes do not."""
    return _ddp(bench, "ddp_step_1rank", 1)


def ddp_step_buckets(bench: Bench) -> dict[str, Any]:
    """The two-rank DDP step with 0.25 MB buckets (4 buckets, where DDP's 25 MB makes one of this model): each
    bucket's all_reduce may overlap the backward pass of the buckets after it, as on a model of hundreds of MB."""
    return _ddp(bench, "ddp_step_buckets", 2, bucket_mb=0.25)


#: A genie client that copies 64 MiB between a device of w1 and one of w2 (node to node), ITERS times after a
#: warm-up of WARMUP seconds of copies (a node forks its next spare session worker when a session starts: on a
#: 2-core host that import competes with the first copies for about two seconds); each copy is timed from its call
#: to the destination's sync answer. The first copy (a new session: its connections, the endpoint's round trip) is
#: reported apart. The client's own data-plane bytes during the timed copies come from the kernel (TCP_INFO: bytes
#: acknowledged and received on its sockets).
PEER_COPY = """
import json, os, socket, statistics, struct, time
import torch, genie
from genie.device.registry import table
genie.init_sync(master_addr="127.0.0.1", master_port=int(os.environ["MASTER_CONTROL_PORT"]), timeout=60,
                backend="tcp")  # the client's link as a remote client has it; the kernel counts its bytes
def wire():
    total = 0
    for conn in table().connections():
        with socket.socket(fileno=os.dup(conn.channel.fileno())) as s:
            acked, received = struct.unpack_from("=QQ", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 120)
        total += acked + received
    return total
src = next(d for d in table().devices if d.node_id == "w1")
dst = next(d for d in table().devices if d.node_id == "w2")
x = torch.randn(16 << 20).to(f"remote_accelerator:{src.index}")
y = torch.empty(16 << 20, device=f"remote_accelerator:{dst.index}")
started = time.perf_counter()
y.copy_(x); dst.connection.sync()                       # the first copy: the peer endpoint, pages on both nodes
first = time.perf_counter() - started
while time.perf_counter() - started < float(os.environ["WARMUP"]):
    y.copy_(x); dst.connection.sync()
src.connection.sync()
times, before = [], wire()
for _ in range(int(os.environ["ITERS"])):
    started = time.perf_counter()
    y.copy_(x)
    dst.connection.sync()
    times.append(time.perf_counter() - started)
spent = (wire() - before) / len(times)
small, syncs = [], []                                   # what a copy costs beside its bytes: 4 KiB copies
for _ in range(50):
    started = time.perf_counter()
    y[:1024].copy_(x[:1024])
    dst.connection.sync()
    small.append(time.perf_counter() - started)
    started = time.perf_counter()
    dst.connection.sync()                               # against a bare round trip to the destination
    syncs.append(time.perf_counter() - started)
assert torch.equal(y[-8:].cpu(), x[-8:].cpu())
genie.shutdown_sync()
print("RESULT " + json.dumps({"seconds": statistics.median(times), "first": first, "client_bytes": spent,
                              "small": statistics.median(small), "sync": statistics.median(syncs)}), flush=True)
"""

#: The anchor: 64 MiB sent over a TCP socket on loopback from one process to another (a sender from tensor
#: memory, a receiver into a preallocated tensor), ITERS times after a warm-up, each timed at the receiver
#: from its "go" to the last byte.
RAW_TCP = """
import json, os, socket, statistics, subprocess, sys, time
import torch
n = 64 << 20
sender = (
    "import socket, sys, torch\\n"
    "data = torch.randn(16 << 20)\\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\\n"
    "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\\n"
    "view = memoryview(data.numpy()).cast('B')\\n"
    "while s.recv(1):\\n"
    "    s.sendall(view)\\n")
listener = socket.create_server(("127.0.0.1", 0))
child = subprocess.Popen([sys.executable, "-c", sender, str(listener.getsockname()[1])])
try:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    into = torch.zeros(n, dtype=torch.uint8)
    view = memoryview(into.numpy()).cast("B")
    times = []
    for i in range(int(os.environ["ITERS"]) + 1):
        started = time.perf_counter()
        conn.sendall(b"g")
        got = 0
        while got < n:
            got += conn.recv_into(view[got:], n - got)
        if i:
            times.append(time.perf_counter() - started)
    conn.close()
finally:
    child.wait(timeout=30)
print("RESULT " + json.dumps({"seconds": statistics.median(times)}), flush=True)
"""


def _child(bench: Bench, script: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``script`` in a child process and read its RESULT line."""
    proc = bench.children.start([sys.executable, "-c", script], env={**LOOPBACK, "ITERS": str(bench.iters), **env})
    log: list[str] = []
    drain(proc.stderr, log)
    try:
        return read_json_line(proc, 600)
    except Exception:
        print(*log[-30:], sep="\n", file=sys.stderr)
        raise
    finally:
        bench.children.stop(proc)


def peer_copy_64mib(bench: Bench) -> dict[str, Any]:
    """64 MiB copied between devices of two nodes (tcp on loopback) against a raw 64 MiB TCP send between two
    processes on the same loopback, and the client's own bytes during each copy."""
    load = os.getloadavg()[0]
    raw_before = _child(bench, RAW_TCP, {})["seconds"]
    remote = _child(bench, PEER_COPY, {"MASTER_CONTROL_PORT": str(bench.cluster().port),
                                       "WARMUP": str(bench.warmup)})
    raw_after = _child(bench, RAW_TCP, {})["seconds"]
    raw = (raw_before + raw_after) / 2
    mib = 64
    return {"row": "peer_copy_64mib", "backend": "tcp", "load_average": round(load, 1), "raw_ms": round(raw * 1e3, 1),
            "raw_before_ms": round(raw_before * 1e3, 1), "raw_after_ms": round(raw_after * 1e3, 1),
            "genie_ms": round(remote["seconds"] * 1e3, 1), "genie_first_ms": round(remote["first"] * 1e3, 1),
            "warmup_s": bench.warmup, "small_copy_ms": round(remote["small"] * 1e3, 2),
            "sync_ms": round(remote["sync"] * 1e3, 2), "raw_mib_s": round(mib / raw),
            "genie_mib_s": round(mib / remote["seconds"]), "rate_ratio": round(raw / remote["seconds"], 2),
            "client_bytes_per_copy": round(remote["client_bytes"]), "target": ">= 0.9, client bytes <= 1024"}


#: Every row of this benchmark, in the order they run (other rows of issue 32 join this list).
ROWS: list[Callable[[Bench], dict[str, Any]]] = [peer_copy_64mib, all_reduce_64mib, ddp_step, ddp_step_1rank,
                                                 ddp_step_buckets]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="", help="comma-separated row names (default: every row)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds of untimed copies before peer_copy_64mib's timed ones (default 5)")
    parser.add_argument("--no-netns", action="store_true", help="run in place, not in a private network namespace")
    args = parser.parse_args()
    wanted = [r for r in args.rows.split(",") if r]
    rows = [row for row in ROWS if not wanted or row.__name__ in wanted]
    with Children() as children:
        bench = Bench(children, args.iters, args.warmup)
        try:
            for row in rows:
                emit(row(bench))
        finally:
            bench.close()
    return 0


if __name__ == "__main__":
    enter_private_netns()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
