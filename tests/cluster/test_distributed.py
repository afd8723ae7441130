"""torch.distributed on remote devices: two client processes, each on a device of its own worker node.

A real cluster on loopback (a master and worker nodes, :class:`~genie.testing.LocalCluster`), two
client processes joined by a ``TCPStore`` this test hosts, ``init_process_group("cpu:gloo,
remote_accelerator:genie")``. Every collective on remote tensors (and DTensor's redistributions,
through torch's functional collectives) is checked against the same collective on CPU tensors
through gloo in the same process group; wrong sizes are refused by the client and by the node; DDP
and FSDP2 (``fully_shard``) on the remote devices against the same on the CPU; a worker node killed while both ranks wait fails both handles with
RemoteDeviceLost naming it. torch.distributed binds and connects loopback only
(``GLOO_SOCKET_IFNAME=lo``, ``MASTER_ADDR=127.0.0.1``).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from genie.testing import LocalCluster, wait_until

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
HB = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "3")

#: Start of every client: genie, the device on node NODE, the process group over the test's store.
PROLOGUE = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
import genie, genie.distributed
from genie.device.registry import table

genie.init_sync(master_addr="127.0.0.1", master_port=int(os.environ["MASTER_CONTROL_PORT"]), timeout=30,
                heartbeat_interval=0.5, heartbeat_timeout=3.0)
rank = int(os.environ["RANK"])
remote = next(d for d in table().devices if d.node_id == os.environ["NODE"])
device = torch.device("remote_accelerator", remote.index)
store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), 2, is_master=False,
                      timeout=datetime.timedelta(seconds=30))
dist.init_process_group("cpu:gloo,remote_accelerator:genie", rank=rank, world_size=2, store=store,
                        timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "20"))))
out = {}
def report():
    print("RESULT " + json.dumps(out), flush=True)
"""

COLLECTIVES = """
def same(name, remote_result, cpu_result):
    out[name] = bool(torch.equal(remote_result.cpu(), cpu_result))

x = torch.arange(6, dtype=torch.float32) * (rank + 1) + rank
for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
    r, c = x.to(device), x.clone()
    dist.all_reduce(r, getattr(dist.ReduceOp, op))
    dist.all_reduce(c, getattr(dist.ReduceOp, op))
    same("all_reduce_" + op, r, c)
r, c = x.to(device), x.clone()
dist.broadcast(r, src=1)
dist.broadcast(c, src=1)
same("broadcast", r, c)
rs, cs = [torch.empty(6, device=device) for _ in range(2)], [torch.empty(6) for _ in range(2)]
dist.all_gather(rs, x.to(device))
dist.all_gather(cs, x)
same("all_gather", torch.stack([t.cpu() for t in rs]), torch.stack(cs))
r, c = torch.empty(12, device=device), torch.empty(12)
dist.all_gather_into_tensor(r, x.to(device))
dist.all_gather_into_tensor(c, x)
same("all_gather_into_tensor", r, c)
chunks = [x * (i + 1) for i in range(2)]
r, c = torch.empty(6, device=device), torch.empty(6)
dist.reduce_scatter(r, [t.to(device) for t in chunks])
dist.reduce_scatter(c, chunks)
same("reduce_scatter", r, c)
r, c = torch.empty(3, device=device), torch.empty(3)
dist.reduce_scatter_tensor(r, x.to(device))
dist.reduce_scatter_tensor(c, x)
same("reduce_scatter_tensor", r, c)
dist.barrier()
out["barrier"] = True
# send/recv between views: one at an offset goes out, a row of a bigger tensor receives
if rank == 0:
    dist.send(torch.arange(24.0).to(device)[12:], dst=1)
    out["send_recv"] = True
else:
    box = torch.zeros(2, 12, device=device)
    dist.recv(box[1], src=0)
    out["send_recv"] = bool(torch.equal(box.cpu(), torch.stack([torch.zeros(12), torch.arange(12.0, 24.0)])))
# async handles: several in flight, waited in reverse; then a future (DDP's way), then a view of it
rs = [x.to(device) + i for i in range(3)]
works = [dist.all_reduce(t, async_op=True) for t in rs]
for w in reversed(works):
    w.wait()
same("async_handles", torch.stack([t.cpu() for t in rs]), torch.stack([torch.arange(6.0) * 3 + 1 + 2 * i
                                                                     for i in range(3)]))
r = x.to(device)
fut = dist.all_reduce(r, async_op=True).get_future()
same("future", fut.wait()[0], torch.arange(6.0) * 3 + 1)
i = torch.tensor([rank + 1], device=device)
dist.all_reduce(i)
out["integers"] = bool(torch.equal(i.cpu(), torch.tensor([3])))
"""

ROOTED_AND_ALL_TO_ALL = """
# reduce (gloo leaves partial results on the other rank: both ranks compare), gather, scatter
for op in ("SUM", "MAX"):
    r, c = x.to(device), x.clone()
    dist.reduce(r, dst=1, op=getattr(dist.ReduceOp, op))
    dist.reduce(c, dst=1, op=getattr(dist.ReduceOp, op))
    same("reduce_" + op, r, c)
rs = [torch.empty(6, device=device) for _ in range(2)] if rank == 0 else None
cs = [torch.empty(6) for _ in range(2)] if rank == 0 else None
dist.gather(x.to(device), rs, dst=0)
dist.gather(x, cs, dst=0)
out["gather"] = rank != 0 or bool(torch.equal(torch.stack([t.cpu() for t in rs]), torch.stack(cs)))
parts = [x * (i + 2) for i in range(2)]
r, c = torch.empty(6, device=device), torch.empty(6)
dist.scatter(r, [p.to(device) for p in parts] if rank == 1 else None, src=1)
dist.scatter(c, parts if rank == 1 else None, src=1)
same("scatter", r, c)
# all_to_all_single in equal parts and in uneven splits of a 2-D tensor's rows; all_to_all of lists
m = torch.arange(8.0).reshape(4, 2) + 100 * rank
r, c = torch.empty(4, 2, device=device), torch.empty(4, 2)
dist.all_to_all_single(r, m.to(device))
dist.all_to_all_single(c, m)
same("all_to_all_single", r, c)
sent, got = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
r, c = torch.empty(sum(got), 2, device=device), torch.empty(sum(got), 2)
dist.all_to_all_single(r, m.to(device), got, sent)
dist.all_to_all_single(c, m, got, sent)
same("all_to_all_single_splits", r, c)
# uneven sizes, as NCCL allows (gloo's all_to_all on CPU wants one size: the reference is all_to_all_single)
ins = [torch.arange(2.0 + peer) + 10 * rank for peer in range(2)]  # rank `peer` receives 2 + peer elements
rl, c = [torch.empty(2 + rank, device=device) for _ in range(2)], torch.empty(4 + 2 * rank)
dist.all_to_all(rl, [t.to(device) for t in ins])
dist.all_to_all_single(c, torch.cat(ins), [2 + rank] * 2, [2, 3])
same("all_to_all", torch.cat([t.cpu() for t in rl]), c)

# wrong sizes: the client refuses before anything is sent, naming the fix (both ranks refuse: nobody waits)
def refused(call, *words):
    try:
        call()
    except Exception as exc:
        text = type(exc).__name__ + ": " + str(exc)
        return all(w in text for w in words) or text
    return "not refused"
out["refuses_bad_splits"] = refused(lambda: dist.all_to_all_single(torch.empty(4, 2, device=device), m.to(device),
                                                                   [1, 1], [2, 2]),
                                    "DeviceError", "output_split_sizes", "adding up to", "4 rows")
out["refuses_unequal_self_part"] = refused(
    lambda: dist.all_to_all_single(torch.empty(4, 2, device=device), m.to(device), [1, 3] if rank else [3, 1], [2, 2]),
    "DeviceError", f"input_split_sizes[{rank}] and output_split_sizes[{rank}] must be equal")
short = [torch.empty(5, device=device) for _ in range(2)]
# (torch itself refuses a gather_list on rank 1: then neither rank waits for the other)
out["refuses_bad_gather_list"] = refused(lambda: dist.gather(x.to(device), short, dst=0),
                                         *(("DeviceError", "gather_list", "each must have the 6") if rank == 0 else
                                           ("ValueError", "gather_list", "non-destination")))
out["refuses_bad_all_to_all"] = refused(lambda: dist.all_to_all([r], [x.to(device)]), "DeviceError",
                                        "one output and one input tensor per rank")
# the same mistakes sent past the client's checks: the node refuses them (the work handle raises), and the
# group goes on
pg = dist.distributed_c10d._get_default_group()
b = pg._binding
bad = [("all_to_all_single", [torch.empty(4, 2, device=device), m.to(device)],
        {"out_splits": [1, 1], "in_splits": [2, 2]}, "out_splits must be 2 row counts adding up to"),
       ("gather", [short if rank == 0 else [short[0]], x.to(device)], {"root": 0},
        "each must have the 6" if rank == 0 else "on the root rank (0) only"),
       ("scatter", [torch.empty(6, device=device), []], {"root": 5}, "root must be a rank from 0 to 1"),
       ("all_to_all", [[r], [x.to(device)]], {}, "one output and one input per rank")]
for kind, tensors, params, words in bad:
    out["node_refuses_" + kind] = refused(lambda: pg._start(b, kind, tensors, params, []).wait(),
                                          "RemoteExecutionError", words)
r = x.to(device)
dist.all_reduce(r)
same("after_refusals", r, torch.arange(6.0) * 3 + 1)
"""

DTENSOR = """
# DTensor's redistributions run torch's functional collectives, which reach the group by name and call its
# coalesced methods; the same redistributions over the group's CPU side (gloo) are the reference
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

meshes = {"remote": DeviceMesh.from_group(dist.group.WORLD, "remote_accelerator"),
          "cpu": DeviceMesh.from_group(dist.group.WORLD, "cpu")}
full, mine = torch.arange(24.0).reshape(4, 6), torch.arange(24.0).reshape(4, 6) * (rank + 1)
got = {}
for where, mesh in meshes.items():
    dev = device if where == "remote" else "cpu"
    sharded = distribute_tensor(full.to(dev), mesh, [Shard(0)])
    partial = DTensor.from_local(mine.to(dev), mesh, [Partial()])
    got[where] = [sharded.full_tensor(), partial.full_tensor(), partial.redistribute(mesh, [Shard(0)]).to_local(),
                  sharded.redistribute(mesh, [Shard(1)]).to_local()]
for i, name in enumerate(("all_gather", "all_reduce", "reduce_scatter", "shard_to_shard")):
    same("dtensor_" + name, got["remote"][i], got["cpu"][i])
rs, cs = [x.to(device), (x * 2).to(device)], [x.clone(), x * 2]
dist.all_reduce_coalesced(rs)
dist.all_reduce_coalesced(cs)
same("all_reduce_coalesced", torch.stack([t.cpu() for t in rs]), torch.stack(cs))
# _coalescing_manager without a device records the all_reduces and runs them as one coalesced call
from torch.distributed.distributed_c10d import _coalescing_manager
rs = [x.to(device), (x * 3).to(device)]
with _coalescing_manager():
    for t in rs:
        dist.all_reduce(t)
same("coalescing_manager", torch.stack([t.cpu() for t in rs]), torch.stack([torch.arange(6.0) * 3 + 1,
                                                                          (torch.arange(6.0) * 3 + 1) * 3]))
# batch_isend_irecv: a ring exchange (each rank sends its x and receives the other's)
box = torch.zeros(6, device=device)
for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, x.to(device), 1 - rank),
                                   dist.P2POp(dist.irecv, box, 1 - rank)]):
    req.wait()
same("batch_isend_irecv", box, torch.arange(6, dtype=torch.float32) * (2 - rank) + (1 - rank))
"""

DDP = """
import copy
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True),
    torch.nn.Linear(32, 32))
if rank == 1:  # DDP's first broadcast must make both ranks start from rank 0's weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
on_remote = DDP(copy.deepcopy(model).to(device))
on_cpu = DDP(copy.deepcopy(model))
optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (on_remote, on_cpu)]
for step in range(3):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, 32, generator=g), torch.randn(4, 8, 32, generator=g)
    for m, opt, dev in ((on_remote, optimizers[0], device), (on_cpu, optimizers[1], "cpu")):
        loss = ((m(x.to(dev)) - y.to(dev)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
diffs = [float((a.detach().cpu() - b.detach()).abs().max()) for a, b in
         zip(on_remote.module.parameters(), on_cpu.module.parameters(), strict=True)]
out["ddp_max_diff"] = max(diffs)
out["ddp_params"] = len(diffs)
"""

FSDP2 = """
# FSDP2 (fully_shard) per layer of a small MLP over the two remote devices, against the same run over gloo on the
# CPU: FSDP2 frees each layer's unsharded parameters with untyped_storage().resize_(0) after use and regrows them
# with resize_(n) before the next all-gather. Last in the body (it sets the current device); an error is reported
# as a result, so the earlier sections' results still come back.
import traceback
def fsdp2():  # a function: its names do not replace the earlier sections' (their tensors stay held)
    from torch.distributed.fsdp import fully_shard

    torch.remote_accelerator.set_device(device.index)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 8))
    on_remote, on_cpu = copy.deepcopy(base), copy.deepcopy(base)
    for model, mesh in ((on_remote, meshes["remote"]), (on_cpu, meshes["cpu"])):
        for layer in (0, 2, 4):
            fully_shard(model[layer], mesh=mesh)
        fully_shard(model, mesh=mesh)
    out["fsdp_param_devices"] = sorted({str(p.device) for p in on_remote.parameters()}) == [str(device)]
    shard_bytes = sum(p.to_local().numel() * 4 for p in on_remote.parameters())
    before = torch.remote_accelerator.memory_allocated(device)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (on_remote, on_cpu)]
    losses = {"remote": [], "cpu": []}
    held = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        for name, m, opt, dev in (("remote", on_remote, optimizers[0], device), ("cpu", on_cpu, optimizers[1], "cpu")):
            loss = ((m(x.to(dev)) - y.to(dev)) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(float(loss))
        held.append(torch.remote_accelerator.memory_allocated(device) - before)
    out["fsdp_losses"] = losses
    # bytes held after each step, in parameter shards: AdamW's two moments and no unsharded parameter (freed)
    out["fsdp_held_shards"] = [h / shard_bytes for h in held]
    out["fsdp_params_equal"] = [bool(torch.equal(a.full_tensor().cpu(), b.full_tensor()))
                                for a, b in zip(on_remote.parameters(), on_cpu.parameters(), strict=True)]
try:
    fsdp2()
except Exception:
    out["fsdp_error"] = traceback.format_exc()[-3000:]
"""


KILLED = """
# Both ranks end up waiting: rank 1 in an all_reduce rank 0 never joins, rank 0 for a message rank 1
# never sends. Then the test kills rank 1's worker node.
warm = torch.ones(1, device=device)
dist.all_reduce(warm)  # the two workers' group has formed: what follows is mid-collective
t = torch.ones(1024, device=device)
work = dist.all_reduce(t, async_op=True) if rank == 1 else dist.irecv(t, src=1)
print("WAITING", flush=True)
try:
    work.wait()
    out["error"] = None
except Exception as exc:
    out["error"] = type(exc).__name__
    out["message"] = str(exc)
    out["node_id"] = getattr(exc, "node_id", None)
out["failed_at"] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of this host
"""

#: A collective started inside a backward pass (as DDP's reducer starts each bucket's) and its future: rank 1
#: joins it 2 s late. Rank 0 meanwhile runs an op on another tensor of its device and reads it; then chains a
#: callback on the future (as a DDP comm hook does) and waits on a second collective's future, both inside the
#: pass; after the pass it reads the reduced tensor.
IN_BACKWARD = """
torch.accelerator.set_device_index(remote.index)
class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if rank == 1:
            time.sleep(2.0)  # not a wait: rank 1 joins the all_reduce 2 s after rank 0
        future = dist.all_reduce(held, async_op=True).get_future()
        out["done_in_backward"] = future.done()
        started = time.perf_counter()
        out["other"] = float(other.sum())  # another tensor of the device: not behind the collective
        out["other_op_s"] = time.perf_counter() - started
        chained.append(future.then(lambda f: f.value()[0].sum()))  # runs once the pass completes the future
        second = torch.ones(2, device=device)
        dist.all_reduce(second, async_op=True).get_future().wait()  # waited in the pass: completes now
        out["second"] = second.cpu().tolist()
        return grad
held = torch.full((4,), float(rank + 1), device=device)
other = torch.full((3,), 2.0, device=device)
chained = []
x = torch.ones(4, device=device, requires_grad=True)
dist.barrier()
Reduce.apply(x).sum().backward()
out["held"] = held.cpu().tolist()
out["chained"] = float(chained[0].wait())
"""


class Ranks:
    """Two client processes (rank 0 on node ``nodes[0]``, rank 1 on ``nodes[1]``) running ``body``."""

    def __init__(self, cluster: LocalCluster, nodes: tuple[str, str], body: str, **env: str) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        script = PROLOGUE + textwrap.dedent(body) + "\nreport()\ngenie.shutdown_sync()\n"
        self.procs = [
            subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, **LOOPBACK, **env, "RANK": str(rank), "NODE": node,
                                             "STORE_PORT": str(self.store.port),
                                             "MASTER_CONTROL_PORT": str(cluster.port)})
            for rank, node in enumerate(nodes)]
        self.lines: list[list[str]] = [[], []]

    def wait_for_line(self, rank: int, text: str, timeout: float) -> None:
        """Read rank ``rank``'s output until a line is ``text`` (bounded: the process is killed past it)."""
        proc = self.procs[rank]
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            self.lines[rank].append(line)
            if line.strip() == text:
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise AssertionError(f"rank {rank} never printed {text!r}:\n{''.join(self.lines[rank])[-3000:]}")

    def results(self, timeout: float) -> list[dict[str, object]]:
        """Each rank's RESULT map, once both exited (killed past ``timeout`` s, with their output shown)."""
        outputs = []
        for rank, proc in enumerate(self.procs):
            try:
                rest, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                rest, _ = proc.communicate()
            outputs.append("".join(self.lines[rank]) + rest)
        found = []
        for output in outputs:
            got = [line[7:] for line in output.splitlines() if line.startswith("RESULT ")]
            assert got, "\n".join(f"rank {r} exited with {p.returncode}:\n{o[-2500:]}"
                                  for r, (p, o) in enumerate(zip(self.procs, outputs, strict=True)))
            found.append(json.loads(got[-1]))
        return found

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(("w1", "w2"), master_args=HB, worker_args=HB, env=LOOPBACK) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def two_ranks(cluster: LocalCluster) -> list[dict[str, object]]:
    """One pair of client processes (on w1 and w2) runs every collective, DTensor's, then DDP and FSDP2: one start-up
    for the tests that read its results."""
    ranks = Ranks(cluster, ("w1", "w2"), COLLECTIVES + ROOTED_AND_ALL_TO_ALL + DTENSOR + DDP + FSDP2)
    try:
        return ranks.results(180)
    finally:
        ranks.stop()


def _refusals(name: str) -> bool:
    return name.startswith(("refuses_", "node_refuses_"))


def _others(name: str) -> bool:
    return name.startswith(("ddp_", "fsdp_")) or _refusals(name)


def test_every_collective_on_remote_devices_equals_gloo_on_cpu(two_ranks: list[dict[str, object]]) -> None:
    for rank, result in enumerate(two_ranks):
        checks = {name: ok for name, ok in result.items() if not _others(name)}
        failed = sorted(name for name, ok in checks.items() if ok is not True)
        assert not failed, f"rank {rank}: remote results differ from gloo's on CPU: {failed}"
        # 8: reduce (2 ops), gather, scatter, all_to_all (3), after the refusals; 7: DTensor (4), coalesced (2),
        # batch_isend_irecv
        assert len(checks) == 15 + 8 + 7


def test_wrong_sizes_are_refused_by_the_client_and_by_the_node_naming_the_fix(
        two_ranks: list[dict[str, object]]) -> None:
    for rank, result in enumerate(two_ranks):
        checks = {name: ok for name, ok in result.items() if _refusals(name)}
        assert len(checks) == 4 + 4, checks
        wrong = {name: ok for name, ok in checks.items() if ok is not True}
        assert not wrong, f"rank {rank}: not refused, or refused without naming the fix: {wrong}"


def test_ddp_on_two_remote_devices_trains_as_ddp_on_cpu(two_ranks: list[dict[str, object]]) -> None:
    for result in two_ranks:
        assert result["ddp_params"] == 14  # the encoder layer's 12 tensors and the head's 2
        assert float(result["ddp_max_diff"]) <= 1e-5, result  # type: ignore[arg-type]


def test_fully_shard_on_two_remote_devices_trains_as_fully_shard_on_cpu(two_ranks: list[dict[str, object]]) -> None:
    for rank, result in enumerate(two_ranks):
        assert "fsdp_error" not in result, f"rank {rank}:\n{result['fsdp_error']}"
        assert result["fsdp_param_devices"] is True, result  # each rank's shards on its own remote device
        losses = result["fsdp_losses"]
        assert losses["remote"] == losses["cpu"], (rank, losses)  # type: ignore[index]  # bit for bit
        assert result["fsdp_params_equal"] == [True] * 6, (rank, result)
        assert result["fsdp_held_shards"] == [2.0, 2.0, 2.0], (rank, result)


def test_a_node_killed_mid_collective_fails_both_handles_with_remote_device_lost(cluster: LocalCluster) -> None:
    victim = cluster.add_worker("w3", *HB)
    process = victim.process
    assert process is not None
    ranks = Ranks(cluster, ("w1", "w3"), KILLED, PG_TIMEOUT="30")
    try:
        for rank in (0, 1):
            ranks.wait_for_line(rank, "WAITING", 90)
        # Both have sent their collective and wait in it; the test kills the node meanwhile.
        time.sleep(0.5)  # not a wait: the kill must land while the collectives are in flight, not before
        killed_at = time.monotonic()
        os.kill(process.pid, signal.SIGKILL)
        results = ranks.results(60)
    finally:
        ranks.stop()
        victim.stop()
    for rank, result in enumerate(results):
        assert result["error"] == "RemoteDeviceLost", (rank, result)
        assert result["node_id"] == "w3", (rank, result)
        assert "w3" in str(result["message"])
    late = max(float(r["failed_at"]) for r in results) - killed_at  # type: ignore[arg-type]
    assert late < 3.0, f"the handles failed {late:.1f} s after the kill (heartbeat timeout 3 s)"
    wait_until(lambda: process.poll() is not None, 10, what="the killed node to be reaped")



def test_a_collective_started_in_backward_holds_no_other_op_of_the_device_until_the_pass_ends(
        cluster: LocalCluster) -> None:
    # DDP's reducer asks for each bucket's future as the bucket is ready; a wait queued into the op stream right
    # then held the rest of the backward pass behind that bucket's all_reduce (and its slowest peer).
    ranks = Ranks(cluster, ("w1", "w2"), IN_BACKWARD)
    try:
        results = ranks.results(120)
    finally:
        ranks.stop()
    first = results[0]
    assert first["done_in_backward"] is False, first
    assert first["other"] == 6.0
    assert float(first["other_op_s"]) < 1.0, f"an op on another tensor waited for the collective: {first}"  # type: ignore[arg-type]
    for result in results:
        assert result["held"] == [3.0] * 4, result  # the all_reduce's result, read after the pass
        assert result["chained"] == 12.0, result  # the future's callback ran after the collective
        assert result["second"] == [2.0, 2.0], result


def test_the_group_store_refuses_a_peer_without_the_group_secret() -> None:
    from genie.errors import AuthenticationError
    from genie.server.node_answers import group_secret
    from genie.server.rendezvous import AuthStore, StoreServer

    secret = group_secret(b"cluster-token", 7)
    server = StoreServer("127.0.0.1", secret)
    try:
        member = AuthStore("127.0.0.1", server.port, secret, 5.0)
        member.set("k", b"v")
        assert member.get("k") == b"v" and member.add("n", 2) == 2 and member.check(["k", "n"])
        member.close()
        for wrong in (group_secret(b"another-token", 7), group_secret(b"cluster-token", 8)):
            with pytest.raises(AuthenticationError):
                AuthStore("127.0.0.1", server.port, wrong, 5.0)
    finally:
        server.close()
