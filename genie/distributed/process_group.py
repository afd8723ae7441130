"""The ``genie`` process group: collectives on remote tensors run between the nodes that hold them.

torch.distributed calls a backend's ``allreduce``, ``broadcast``, ``allgather`` ... with the
tensors and an options object, and waits on the returned work handle. For remote tensors this
process group sends one command to the session of the tensors' device (``CMD_COLLECTIVE``,
fire-and-forget, in the session's op stream: every op queued before it has run when it starts);
the session worker runs the collective with its peers' workers (:mod:`genie.server.collectives`).
The first collective binds the process group to that device: rank 0's worker hosts the group's
store, and each rank learns where through the process group's own client store (the one
``init_process_group`` was given). CPU tensors go to an ordinary gloo group among the clients.

A handle's :meth:`GenieWork.wait` is a sync point: it returns once the collective ended on this
rank's worker, and raises :class:`~genie.errors.RemoteDeviceLost` naming the node when a peer's
node was lost mid-collective. :meth:`GenieWork.get_future` (what DDP uses) does not block: its
future's completion queues a wait into the op stream (ops queued after it run after the
collective), at once outside a backward pass and at the end of the pass inside one (or when Python
waits on it first), so DDP's later buckets and the rest of the backward pass run meanwhile; a
failure surfaces at the next sync point.
"""

from __future__ import annotations

import datetime
import logging
import math
import secrets
import threading
import time
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from genie.errors import DeviceError, GenieError, RemoteDeviceLost, RemoteExecutionError
from genie.wire import messages as wm

log = logging.getLogger("genie.distributed")

#: The backend's name in ``init_process_group("cpu:gloo,remote_accelerator:genie")``.
BACKEND_NAME = "genie"
_DEVICE_TYPE = "remote_accelerator"
#: Longest one wait request stays at the node before it answers "pending" (the client then asks again), so a
#: collective that waits for a slow peer never trips the connection's own reply timeout.
WAIT_SLICE = 10.0

_registered = threading.Lock()


def register() -> None:
    """Register the ``genie`` backend with torch.distributed (idempotent; ``import genie.distributed`` does it)."""
    with _registered:
        if BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=[_DEVICE_TYPE, "cpu"])


def _create(opts: Any, backend_options: Any) -> GenieProcessGroup:
    # torch returns a Python process group as the whole group: a gloo backend it made just before for
    # "cpu:gloo" is dropped. Every rank waits here until all made theirs, so no rank tears its gloo
    # down while another still connects to it (gloo's full mesh then fails with "closed by peer").
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    store.set(f"genie/created/{rank}", b"1")
    store.wait([f"genie/created/{r}" for r in range(size)])
    return GenieProcessGroup(store, rank, size, opts.timeout)


_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.PRODUCT: "product"}


def _op_name(op: Any) -> str:
    for known, name in _OPS.items():
        if op == known:
            return name
    raise DeviceError(f"reduce op {op} is not supported on remote devices; use SUM, AVG, MAX, MIN or PRODUCT")


def _row(t: torch.Tensor) -> int:
    """Elements of one row (past dimension 0) of ``t``."""
    return math.prod(t.shape[1:])


def _is_remote(t: torch.Tensor) -> bool:
    return t.device.type == _DEVICE_TYPE


class _Binding:
    """The remote device a process group's collectives run on, and its server-side group."""

    def __init__(self, index: int, group_id: int, timeout: float) -> None:
        from genie.device.dispatch import encoder_for
        from genie.device.registry import device_at

        self.index = index
        self.device = device_at(index)
        self.conn = self.device.connection
        self.encoder = encoder_for(self.device)
        self.group_id = group_id
        self.timeout = timeout
        self.seq = 0
        self.lock = threading.Lock()


class GenieWork(dist.Work):
    """A collective's handle: :meth:`wait` is a sync point; :meth:`get_future` orders the op stream instead."""

    def __init__(self, binding: _Binding | None, seq: int, outputs: list[torch.Tensor], label: str,
                 done: Any = None) -> None:
        super().__init__()
        self._binding = binding
        self._seq = seq
        self._outputs = outputs
        self._label = label
        self._gloo = done  # a CPU collective's gloo handle
        self._done = binding is None and done is None
        self._error: GenieError | None = None
        self._order_lock = threading.Lock()

    def is_completed(self) -> bool:  # noqa: D102 - torch.distributed.Work's API
        return self._done

    def is_success(self) -> bool:  # noqa: D102
        return self._done and self._error is None

    def result(self) -> list[torch.Tensor]:  # noqa: D102
        return self._outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the collective ended on this rank's node; RemoteDeviceLost when a peer's node was lost."""
        if self._gloo is not None:
            self._gloo.wait()
            self._done = True
            return True
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        b = self._binding
        assert b is not None
        limit = b.timeout + WAIT_SLICE
        if timeout is not None and timeout.total_seconds() > 0:
            limit = min(limit, timeout.total_seconds())
        deadline = time.monotonic() + limit
        while True:
            budget = max(0.0, min(WAIT_SLICE, deadline - time.monotonic()))
            result = b.conn.request([wm.CMD_DIST_WAIT, 0, b.group_id, self._seq, budget], device=b.device.label)
            if result is None:
                self._done = True
                return True
            if isinstance(result, dict) and result.get("pending"):
                if time.monotonic() < deadline:
                    continue
                self._error = RemoteExecutionError(f"{self._label} on {b.device.label} did not end within "
                                                   f"{limit:g} s; raise the process group's timeout if peers are slow")
            elif isinstance(result, dict) and isinstance(result.get("node"), str):
                self._error = RemoteDeviceLost(f"{self._label} on {b.device.label}: {result.get('error')}",
                                               node_id=result["node"], device=b.device.label)
            else:
                error = result.get("error") if isinstance(result, dict) else result
                self._error = RemoteExecutionError(f"{self._label} on {b.device.label}: {error}")
            self._done = True
            raise self._error

    def get_future(self) -> torch.futures.Future:
        """A future of the output tensors; the device's ops queued after it completes run after the collective.

        No round trip: a wait joins the op stream, and a failure is raised at the next sync point. Outside a
        backward pass the future is completed at once. Inside one (DDP's reducer asks for each bucket's future
        as the bucket's gradients are ready) it completes at the end of the pass, or when Python waits on it
        or reads it, whichever comes first: the rest of the backward pass runs on the node meanwhile, as
        NCCL's collectives overlap it, where a wait queued now would hold every later op of the device
        behind this collective and its peers.
        """
        if self._gloo is not None:
            return self._gloo.get_future()
        return _future([self], self._outputs)

    def order_stream(self) -> None:
        """Queue the op stream's wait for this collective (once): the device's later ops run after it."""
        with self._order_lock:
            b = self._binding
            if b is None or self._done:
                return
            b.conn.command([wm.CMD_DIST_WAIT, None, b.group_id, self._seq, 0.0])
            self._done = True


class _DeferredFuture(torch.futures.Future):
    """The future of collectives started inside a backward pass: completed (their stream waits queued first) by
    :meth:`order`, which the end of the pass calls, and which a wait or read from Python calls first."""

    def __init__(self, works: list[GenieWork], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._works = works
        self._outputs = outputs
        self._lock = threading.Lock()
        self._ordered = False

    def order(self) -> None:
        """Queue each collective's stream wait, then complete the future (its callbacks run now, after them)."""
        for work in self._works:
            work.order_stream()
        with self._lock:
            first, self._ordered = not self._ordered, True
        if first:
            self.set_result(self._outputs)

    def wait(self) -> list[torch.Tensor]:  # noqa: D102 - torch.futures.Future's API
        self.order()
        return super().wait()

    def value(self) -> list[torch.Tensor]:  # noqa: D102
        self.order()
        return super().value()


def _future(works: list[GenieWork], outputs: list[torch.Tensor]) -> torch.futures.Future:
    """``works``' future: completed now, or at the end of the backward pass this thread runs (see get_future)."""
    if torch._C._current_graph_task_id() != -1:
        deferred = _DeferredFuture(works, outputs)
        torch.autograd.Variable._execution_engine.queue_callback(deferred.order)  # type: ignore[attr-defined]
        return deferred
    for work in works:
        work.order_stream()
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(outputs)
    return future


class GenieWorks(dist.Work):
    """The handle of a coalesced call: one collective per tensor, waited together."""

    def __init__(self, works: list[GenieWork], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._works = works
        self._outputs = outputs

    def is_completed(self) -> bool:  # noqa: D102 - torch.distributed.Work's API
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:  # noqa: D102
        return all(w.is_success() for w in self._works)

    def result(self) -> list[torch.Tensor]:  # noqa: D102
        return self._outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for each collective (a sync point; the first failure is raised)."""
        for work in self._works:
            work.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        """A future of the outputs; the device's ops queued after it completes run after every collective of
        the call (completed at once, or at the end of a backward pass, as :meth:`GenieWork.get_future`)."""
        return _future(self._works, self._outputs)


class GenieProcessGroup(dist.ProcessGroup):
    """torch.distributed's process group for remote tensors (and, through gloo, CPU tensors)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs name only the store form
        self._store = store
        self._timeout = timeout
        self._timeout_s = max(1.0, timeout.total_seconds())
        self._binding: _Binding | None = None
        self._cpu: Any = None
        self._lock = threading.Lock()
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``genie``."""
        return BACKEND_NAME

    # torch keeps a group's name in its backends; this group is its own backend, so it keeps them itself
    # (DeviceMesh.from_group, FSDP2 and the functional collectives look groups up by name).
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Called by torch.distributed when the group is made."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        """The name torch.distributed gave this group."""
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        """Called by torch.distributed when the group is made."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        """The description torch.distributed gave this group."""
        return self._group_desc

    # -- binding ----------------------------------------------------------------------------------
    def _gloo(self) -> Any:
        """The clients' own gloo group, for CPU tensors (made by every rank at its first CPU collective)."""
        with self._lock:
            if self._cpu is None:
                options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                options._devices = [dist.ProcessGroupGloo.create_default_device()]
                options._timeout = self._timeout
                self._cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu", self._store), self.rank(), self.size(),
                                                  options)
            return self._cpu

    def _bind(self, index: int) -> _Binding:
        """The server-side group on device ``index`` (formed at the first remote collective, by every rank)."""
        with self._lock:
            if self._binding is not None:
                if self._binding.index != index:
                    raise DeviceError(
                        f"this process group runs its collectives on {self._binding.device.label}, not "
                        f"remote_accelerator:{index}: one remote device per rank (as one GPU per rank with NCCL)")
                return self._binding
            rank, size = self.rank(), self.size()
            if rank == 0:
                group_id = secrets.randbits(62) + 1
                probe = _Binding(index, group_id, self._timeout_s)
                hosted = probe.conn.request([wm.CMD_DIST_HOST, 0, group_id], device=probe.device.label)
                where = {"group": group_id, "node": probe.device.node_id, "port": int(hosted["port"])}
                self._store.set("genie/rendezvous", msgpack.packb(where))
            where = msgpack.unpackb(self._store.get("genie/rendezvous"))
            binding = _Binding(index, int(where["group"]), self._timeout_s)
            self._store.set(f"genie/node/{rank}", binding.device.node_id.encode())
            nodes = [self._store.get(f"genie/node/{r}").decode() for r in range(size)]
            binding.conn.command([wm.CMD_DIST_JOIN, binding.device.local_index, binding.group_id, rank, size,
                                  str(where["node"]), int(where["port"]), nodes, self._timeout_s])
            log.info("process group %d: rank %d of %d on %s (node %s)", binding.group_id, rank, size,
                     binding.device.label, binding.device.node_id)
            self._binding = binding
            return binding

    def _remote_binding(self, tensors: list[torch.Tensor], what: str) -> _Binding | None:
        """None where every tensor is on the CPU; else the binding of their one remote device."""
        remote = [t for t in tensors if _is_remote(t)]
        if not remote:
            return None
        if len(remote) != len(tensors):
            raise DeviceError(f"{what} mixes CPU and remote tensors; put them all on one device")
        index = remote[0].get_device()
        if any(t.get_device() != index for t in remote):
            raise DeviceError(f"{what} spans several remote devices; one remote device per rank")
        return self._bind(index)

    def _start(self, b: _Binding, kind: str, tensors: Any, params: dict[str, Any],
               outputs: list[torch.Tensor]) -> GenieWork:
        from genie.device import shadows

        shadows.forget_tensors(outputs)  # the collective writes them on the node: a host copy here is stale
        with b.lock:
            b.seq += 1
            seq = b.seq
            cmd = [wm.CMD_COLLECTIVE, b.device.local_index, b.group_id, seq, kind, tensors, params]
            b.conn.queue(msgpack.packb(cmd, use_bin_type=True, default=b.encoder))
        return GenieWork(b, seq, outputs, f"{kind} #{seq} of process group {b.group_id}")

    @staticmethod
    def _cpu_work(work: Any, outputs: list[torch.Tensor]) -> GenieWork:
        return GenieWork(None, 0, outputs, "", done=work)

    # -- collectives (torch.distributed's ProcessGroup interface) --------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GenieWork:  # type: ignore[override]  # noqa: D102
        opts = opts if opts is not None else dist.AllreduceOptions()
        b = self._remote_binding(tensors, "all_reduce")
        if b is None:
            return self._cpu_work(self._gloo().allreduce(tensors, opts), tensors)
        return self._start(b, "all_reduce", tensors, {"op": _op_name(opts.reduceOp)}, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GenieWork:  # type: ignore[override]  # noqa: D102
        opts = opts if opts is not None else dist.BroadcastOptions()
        b = self._remote_binding(tensors, "broadcast")
        if b is None:
            return self._cpu_work(self._gloo().broadcast(tensors, opts), tensors)
        return self._start(b, "broadcast", tensors, {"root": int(opts.rootRank)}, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> GenieWork:  # noqa: D102
        opts = opts if opts is not None else AllgatherOptions()
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise DeviceError("all_gather on remote devices takes one input tensor per rank")
        b = self._remote_binding([*output_tensors[0], *input_tensors], "all_gather")
        if b is None:
            return self._cpu_work(self._gloo().allgather(output_tensors, input_tensors, opts), output_tensors[0])
        return self._start(b, "all_gather", [output_tensors[0], input_tensors[0]], {}, output_tensors[0])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> GenieWork:  # noqa: D102
        opts = opts if opts is not None else AllgatherOptions()
        b = self._remote_binding([output, input], "all_gather_into_tensor")
        if b is None:
            return self._cpu_work(self._gloo()._allgather_base(output, input, opts), [output])
        return self._start(b, "all_gather_into", [output, input], {}, [output])

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> GenieWork:  # noqa: D102
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise DeviceError("reduce_scatter on remote devices takes one output tensor per rank")
        b = self._remote_binding([*output_tensors, *input_tensors[0]], "reduce_scatter")
        if b is None:
            return self._cpu_work(self._gloo().reduce_scatter(output_tensors, input_tensors, opts), output_tensors)
        return self._start(b, "reduce_scatter", [output_tensors[0], input_tensors[0]],
                           {"op": _op_name(opts.reduceOp)}, output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> GenieWork:  # noqa: D102
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        b = self._remote_binding([output, input], "reduce_scatter_tensor")
        if b is None:
            return self._cpu_work(self._gloo()._reduce_scatter_base(output, input, opts), [output])
        return self._start(b, "reduce_scatter_tensor", [output, input], {"op": _op_name(opts.reduceOp)}, [output])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                          opts: Any = None) -> GenieWork:
        """``dist.all_gather_into_tensor`` (torch 2.13 calls it by this name)."""
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                              opts: Any = None) -> GenieWork:
        """``dist.reduce_scatter_tensor`` (torch 2.13 calls it by this name)."""
        return self._reduce_scatter_base(output, input, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GenieWork:  # type: ignore[override]  # noqa: D102
        opts = opts if opts is not None else dist.ReduceOptions()
        if len(tensors) != 1:
            raise DeviceError("reduce on remote devices takes one tensor per rank")
        b = self._remote_binding(tensors, "reduce")
        if b is None:
            return self._cpu_work(self._gloo().reduce(tensors, opts), tensors)
        root = self._root(opts.rootRank, "reduce")
        # gloo leaves partial sums in the other ranks' tensors too: they are outputs everywhere
        return self._start(b, "reduce", tensors, {"op": _op_name(opts.reduceOp), "root": root}, tensors)

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any = None) -> GenieWork:  # noqa: D102
        opts = opts if opts is not None else dist.GatherOptions()
        root = self._root(opts.rootRank, "gather")
        if len(input_tensors) != 1:
            raise DeviceError("gather on remote devices takes one input tensor per rank")
        outs = self._root_list(output_tensors, root, "gather", "gather_list", input_tensors[0])
        b = self._remote_binding([*outs, *input_tensors], "gather")
        if b is None:
            return self._cpu_work(self._gloo().gather(output_tensors, input_tensors, opts), outs)
        return self._start(b, "gather", [outs, input_tensors[0]], {"root": root}, outs)

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> GenieWork:  # noqa: D102
        opts = opts if opts is not None else dist.ScatterOptions()
        root = self._root(opts.rootRank, "scatter")
        if len(output_tensors) != 1:
            raise DeviceError("scatter on remote devices takes one output tensor per rank")
        ins = self._root_list(input_tensors, root, "scatter", "scatter_list", output_tensors[0])
        b = self._remote_binding([*output_tensors, *ins], "scatter")
        if b is None:
            return self._cpu_work(self._gloo().scatter(output_tensors, input_tensors, opts), output_tensors)
        return self._start(b, "scatter", [output_tensors[0], ins], {"root": root}, output_tensors)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> GenieWork:
        """``dist.all_to_all_single`` (torch 2.13 calls it by this name; older ones ``alltoall_base``)."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        out_splits = self._splits(output, list(output_split_sizes), "output")
        in_splits = self._splits(input, list(input_split_sizes), "input")
        if output.dtype != input.dtype:
            raise DeviceError(f"all_to_all_single's output is {output.dtype} and its input {input.dtype}; "
                              "give both one dtype")
        if _row(output) != _row(input):
            raise DeviceError(f"all_to_all_single's output rows hold {_row(output)} elements and its input rows "
                              f"{_row(input)}; both must have the same sizes past dimension 0")
        rank, size = self.rank(), self.size()
        to_self = in_splits[rank] if in_splits else (input.shape[0] if input.dim() else 1) // size
        from_self = out_splits[rank] if out_splits else (output.shape[0] if output.dim() else 1) // size
        if to_self != from_self:
            raise DeviceError(f"all_to_all_single: rank {rank} sends itself {to_self} rows but expects {from_self} "
                              f"from itself; input_split_sizes[{rank}] and output_split_sizes[{rank}] must be equal")
        b = self._remote_binding([output, input], "all_to_all_single")
        if b is None:
            return self._cpu_work(self._gloo().alltoall_base(output, input, list(output_split_sizes),
                                                             list(input_split_sizes), opts), [output])
        return self._start(b, "all_to_all_single", [output, input],
                           {"out_splits": out_splits, "in_splits": in_splits}, [output])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> GenieWork:
        """The older name of :meth:`all_to_all_single`."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],  # type: ignore[override]
                 opts: Any = None) -> GenieWork:
        """``dist.all_to_all``: input ``i`` goes to rank ``i``, output ``i`` comes from rank ``i``."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        size = self.size()
        if len(output_tensors) != size or len(input_tensors) != size:
            raise DeviceError(f"all_to_all takes one output and one input tensor per rank ({size} each), got "
                              f"{len(output_tensors)} and {len(input_tensors)}; give lists of world_size tensors")
        dtypes = {t.dtype for t in (*output_tensors, *input_tensors)}
        if len(dtypes) != 1:
            raise DeviceError("all_to_all's tensors have several dtypes; give them all one dtype")
        b = self._remote_binding([*output_tensors, *input_tensors], "all_to_all")
        if b is None:
            return self._cpu_work(self._gloo().alltoall(output_tensors, input_tensors, opts), output_tensors)
        return self._start(b, "all_to_all", [list(output_tensors), list(input_tensors)], {}, list(output_tensors))

    # -- coalesced calls: one collective per tensor, in order (what the functional collectives use) --
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> GenieWorks:  # type: ignore[override]
        """``dist.all_reduce_coalesced``: an all_reduce of each tensor."""
        one = dist.AllreduceOptions()
        if opts is not None:
            one.reduceOp = opts.reduceOp
        return GenieWorks([self.allreduce([t], one) for t in tensors], tensors)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],  # type: ignore[override]
                                    opts: Any = None) -> GenieWorks:
        """All-gathers into tensors, one per pair (DTensor's and torch.compile's functional all_gather)."""
        if len(outputs) != len(inputs):
            raise DeviceError(f"a coalesced all_gather pairs outputs with inputs: {len(outputs)} outputs for "
                              f"{len(inputs)} inputs; give one output per input")
        return GenieWorks([self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)], outputs)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],  # type: ignore[override]
                                        inputs: list[torch.Tensor], opts: Any = None) -> GenieWorks:
        """Reduce-scatters of tensors, one per pair (the functional reduce_scatter_tensor)."""
        if len(outputs) != len(inputs):
            raise DeviceError(f"a coalesced reduce_scatter pairs outputs with inputs: {len(outputs)} outputs for "
                              f"{len(inputs)} inputs; give one output per input")
        return GenieWorks([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
                          outputs)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],  # type: ignore[override]
                                        opts: Any = None) -> GenieWorks:
        """The older name of :meth:`all_gather_single_coalesced`."""
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],  # type: ignore[override]
                                        inputs: list[torch.Tensor], opts: Any = None) -> GenieWorks:
        """The older name of :meth:`reduce_scatter_single_coalesced`."""
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],  # type: ignore[override]
                            inputs: list[torch.Tensor], opts: Any = None) -> GenieWorks:
        """``dist.all_gather_coalesced``: an all_gather of each input into its list."""
        if len(output_lists) != len(inputs):
            raise DeviceError(f"all_gather_coalesced takes one output list per input: {len(output_lists)} lists "
                              f"for {len(inputs)} inputs")
        works = [self.allgather([outs], [i]) for outs, i in zip(output_lists, inputs, strict=True)]
        return GenieWorks(works, [t for outs in output_lists for t in outs])

    # -- argument checks (the node checks them again: it trusts no client) ------------------------
    def _root(self, root: Any, what: str) -> int:
        if not 0 <= int(root) < self.size():
            raise DeviceError(f"{what}'s root rank {root} is not in this group of {self.size()} ranks")
        return int(root)

    def _root_list(self, lists: list[list[torch.Tensor]], root: int, what: str, name: str,
                   mine: torch.Tensor) -> list[torch.Tensor]:
        """The root's list of one tensor per rank (each with ``mine``'s elements and dtype); [] on other ranks."""
        if self.rank() != root:
            if lists and lists[0]:
                raise DeviceError(f"{what}: only the root rank ({root}) gives a {name}; pass none on rank "
                                  f"{self.rank()}")
            return []
        tensors = lists[0] if len(lists) == 1 else []
        if len(tensors) != self.size():
            raise DeviceError(f"{what}'s {name} on the root holds {len(tensors)} tensors; give one per rank "
                              f"({self.size()})")
        for t in tensors:
            if t.numel() != mine.numel() or t.dtype != mine.dtype:
                raise DeviceError(f"{what}'s {name} holds a {t.dtype} tensor of {t.numel()} elements; each must "
                                  f"have the {mine.numel()} {mine.dtype} elements of this rank's tensor")
        return list(tensors)

    def _splits(self, t: torch.Tensor, splits: list[int], what: str) -> list[int]:
        size = self.size()
        rows = t.shape[0] if t.dim() else 1
        if not splits:
            if rows % size:
                raise DeviceError(f"all_to_all_single's {what} has {rows} rows, not a multiple of the world size "
                                  f"({size}); give {what}_split_sizes")
            return []
        if len(splits) != size or any(int(s) < 0 for s in splits) or sum(int(s) for s in splits) != rows:
            raise DeviceError(f"all_to_all_single's {what}_split_sizes {splits} must be {size} non-negative "
                              f"numbers adding up to the {what}'s {rows} rows (dimension 0)")
        return [int(s) for s in splits]

    def barrier(self, opts: Any = None) -> GenieWork:
        """A barrier among the ranks' session workers (the CPU group's when no remote device is bound yet and the
        current device is not remote)."""
        b = self._binding
        if b is None:
            from genie.device.registry import current_index, table

            if not len(table()):
                return self._cpu_work(self._gloo().barrier(), [])
            b = self._bind(current_index())
        return self._start(b, "barrier", [], {}, [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> GenieWork:  # noqa: D102
        b = self._remote_binding(tensors, "send")
        if b is None:
            return self._cpu_work(self._gloo().send(tensors, dst, tag), [])
        return self._start(b, "send", tensors, {"peer": int(dst), "tag": int(tag)}, [])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> GenieWork:  # noqa: D102
        b = self._remote_binding(tensors, "recv")
        if b is None:
            return self._cpu_work(self._gloo().recv(tensors, src, tag), tensors)
        return self._start(b, "recv", tensors, {"peer": int(src), "tag": int(tag)}, tensors)

    def shutdown(self) -> None:
        """Leave the server-side group (best effort: the session's end drops it anyway)."""
        b, self._binding = self._binding, None
        if b is not None and b.conn.lost is None:
            try:
                b.conn.command([wm.CMD_DIST_LEAVE, b.group_id])
            except GenieError:
                pass  # the node is gone: so is the group
