"""``torch.accelerator.Graph`` on ``remote_accelerator``: capture the op stream on the client, replay it with one command.

torch 2.13 builds ``torch.accelerator.Graph`` over ``at::GraphImplInterface`` and lets each device
type register its implementation (``ATen/core/GraphImplInterface.h``); genie._C registers one for the
renamed PrivateUse1 (``genie/csrc/device/graph.cpp``) that forwards each call to a :class:`RemoteGraph`.
So the CUDA idiom works unchanged::

    g = torch.accelerator.Graph()
    with g:                              # capture: nothing runs, nothing is sent
        static_loss = train_step(static_x, static_y)
    for x, y in loader:
        static_x.copy_(x); static_y.copy_(y)
        g.replay()                       # one CMD_REPLAY
        print(static_loss.item())

Semantics are CUDA graphs' (static addresses):

- While a graph captures on a device, every op queued for that device's session is recorded, not
  sent (genie._C's native op path is paused, so every op comes through Python). The ops' outputs
  get storage ids as usual, with no server storage behind them yet: their values exist after the
  first ``replay()``.
- Tensors that existed before the capture are the graph's inputs, read and written in place on
  every replay (parameters, optimizer state, the static inputs the user copies new data into).
  Tensors made during the capture that are still referenced when it ends are its outputs: every
  replay writes them, at the same storage ids (the graph keeps them alive, as a CUDA graph's pool
  does). Everything else is an intermediate, dropped by the server after its last use.
- Numbers (learning rates, scalars) are captured by value. An optimizer must keep its step on the
  device (``fused=True`` or ``capturable=True``), as CUDA requires.
- Sync points (``.item()``, ``.cpu()``, printing, data-dependent shapes), host-to-device copies of
  more than a scalar and storage resizes raise :class:`~genie.errors.GraphCaptureError` and
  invalidate the capture, as CUDA raises "operation not permitted when stream is capturing".

At ``capture_end`` (or the first replay, with ``keep_graph=True``) the recording becomes a graph in
the schema of :mod:`genie.wire.graph` and is defined on the node with ``CMD_GRAPH`` (one round
trip): the same validation as ``torch.compile(backend="genie")``'s graphs (op allow-list, argument
checks, the replay gate of :mod:`genie.server.graph_gate`). A replay is one prepacked ``CMD_REPLAY``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import msgpack
import torch

from genie import _C
from genie.device import dispatch, registry
from genie.device.registry import RemoteDevice
from genie.errors import GraphCaptureError
from genie.wire import messages as wm
from genie.wire.graph import Ref, encode_definition
from genie.wire.values import DTYPES, EXT_TENSOR, MAX_INLINE_TENSOR_BYTES, dtype_from_code

log = logging.getLogger("genie.device.graphs")

_graph_numbers = itertools.count(1)
#: Graph ids for captured graphs: the upper half of the 63-bit id space, so they never meet genie.compile's.
_graph_ids = itertools.count(1 << 62)
_CUDA_HINT = "as CUDA refuses it with \"operation not permitted when stream is capturing\""

#: A tensor argument as recorded: its descriptor (storage id, dtype code, sizes, strides, offset, storage bytes).
Desc = tuple[int, int, tuple[int, ...], tuple[int, ...], int, int]


class _Tensor:
    """A remote tensor argument, frozen at record time (its descriptor then, not its layout later)."""

    __slots__ = ("desc",)

    def __init__(self, desc: Desc) -> None:
        self.desc = desc


class _Host:
    """A small CPU tensor argument (a scalar), copied at record time: a graph input sent inline with each replay."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def _desc(raw: Any) -> Desc:
    sid, code, sizes, strides, offset, nbytes = raw
    return (int(sid), int(code), tuple(sizes), tuple(strides), int(offset), int(nbytes))


def _out_desc(out: Any) -> Desc | None:
    """An op's output descriptor as conn.op receives it: an EXT_TENSOR ext value, a plain list, or None."""
    if out is None:
        return None
    if isinstance(out, msgpack.ExtType):
        return _desc(msgpack.unpackb(out.data))
    return _desc(out)


def _tensor_ext(desc: Desc) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb(list(desc)))


def _overload(name: str) -> Any:
    """The OpOverload of an op name the client itself queued (``aten::add.Tensor``): never a network string."""
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    return dispatch.overload_of(namespace, op, overload)


def _items(name: str, count: int) -> list[int]:
    """Where each of an op's ``count`` flattened outputs sits in its result: -1 for the whole result, else an item."""
    returns = _overload(name)._schema.returns
    kinds = [str(r.type) for r in returns]
    if len(kinds) == 1 and kinds[0].startswith("Tensor") and "[]" not in kinds[0]:
        return [-1] * count
    if len(kinds) == 1 or all(k.startswith("Tensor") and "[]" not in k for k in kinds):
        return list(range(count))  # one list return, or one tensor per return
    raise GraphCaptureError(f"{name} returns {', '.join(kinds)}: a captured graph cannot refer to its outputs")


class Capture:
    """The recording of one capture on one device's session (``NodeConnection.capture`` while it runs)."""

    def __init__(self, device: RemoteDevice) -> None:
        self.device = device
        #: storage ids from this one on were handed out during the capture (ids only grow)
        self.watermark = _C.new_storage_id()
        self.ops: list[tuple[str, Any, Any, list[Desc | None]]] = []
        #: every storage an op used or made, by id: the capture keeps them alive while it runs, so that at its
        #: end a storage only the capture holds is known to be an intermediate
        self.storages: dict[int, torch.UntypedStorage] = {}
        #: generators random ops named (None: the device's default one)
        self.generators: dict[int, torch.Generator | None] = {}
        #: why the capture is invalid (the first reason), or None
        self.error: str | None = None

    # -- called by the session while capturing --------------------------------------------------------
    def record(self, local: int, name: str, args: Any, kwargs: Any, outs: list[Any]) -> None:
        """An op queued for the session (under its lock). Never raises: inside autograd's backward an
        exception would abort the process (see NodeConnection.queue); problems surface at capture_end."""
        if self.error is not None:
            return
        try:
            if local != self.device.local_index:
                raise GraphCaptureError(f"{name} ran on another device of node {self.device.node_id} (local "
                                        f"index {local}); a graph captures the ops of {self.device.label} only")
            frozen_args, frozen_kwargs = self._freeze(args), {k: self._freeze(v) for k, v in kwargs.items()}
            self.ops.append((name, frozen_args, frozen_kwargs, [_out_desc(o) for o in outs]))
            info = dispatch.op_info(_overload(name))
            if info.random:
                g = dispatch._arg(info, info.generator_pos, args, kwargs) if info.generator_pos is not None else None
                self.generators[id(g)] = g
        except Exception as exc:  # recorded, raised by capture_end
            self.error = f"{name}: {exc}"

    def fresh(self, outs: list[Any]) -> None:
        """An op's outputs as the op path made them (before it queues the op): the capture holds their storages."""
        for t in outs:
            if isinstance(t, torch.Tensor) and t.get_device() >= 0:
                sid = _C.storage_id(t)
                if sid and sid not in self.storages:
                    self.storages[sid] = t.untyped_storage()

    def refuse(self, what: str) -> GraphCaptureError:
        """Invalidate the capture because ``what`` cannot be captured; the error to raise."""
        message = (f"{what} cannot run while a torch.accelerator.Graph is capturing on {self.device.label}, "
                   f"{_CUDA_HINT}; run it before the capture or after replay(). The capture is invalidated.")
        if self.error is None:
            self.error = message
        return GraphCaptureError(message)

    def _freeze(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.get_device() >= 0:
                desc = _desc(dispatch.descriptor(value))
                if desc[0] and desc[0] not in self.storages:
                    self.storages[desc[0]] = value.untyped_storage()
                return _Tensor(desc)
            if value.nbytes > MAX_INLINE_TENSOR_BYTES:
                raise GraphCaptureError(f"a CPU tensor of {value.nbytes} bytes is an argument; copy it into a "
                                        "device tensor before the capture")
            return _Host(value.detach().clone())
        if isinstance(value, (list, tuple)):
            return [self._freeze(v) for v in value]
        return value


class _Built:
    """A recording turned into a graph definition and its replay command's parts."""

    def __init__(self, capture: Capture) -> None:
        device = capture.device
        self.inputs: list[Any] = []  # per input slot: a descriptor (ext value) or a CPU tensor
        input_slots: dict[Any, int] = {}
        for _, args, kwargs, _ in capture.ops:  # pass 1: the inputs, in order of first use
            for leaf in _leaves([args, list(kwargs.values())]):
                if isinstance(leaf, _Tensor) and (leaf.desc[0] < capture.watermark or not leaf.desc[0]):
                    if leaf.desc not in input_slots:
                        input_slots[leaf.desc] = len(self.inputs)
                        self.inputs.append(_tensor_ext(leaf.desc))
                elif isinstance(leaf, _Host):
                    input_slots[id(leaf)] = len(self.inputs)
                    self.inputs.append(leaf.value)
        n = len(self.inputs)
        self.nodes: list[list[Any]] = []
        producers: dict[int, tuple[int, int, Desc]] = {}  # storage id -> (slot, item, descriptor of that value)
        views: dict[Desc, Ref] = {}
        torch_device = dispatch.torch_device(device.index)

        def emit(node: list[Any]) -> int:
            self.nodes.append(node)
            return n + len(self.nodes) - 1

        def produced(sid: int, nbytes: int, code: int) -> tuple[int, int, Desc]:
            found = producers.get(sid)
            if found is None:
                # Made during the capture by a kernel that sends nothing (torch.empty and the factories over it):
                # the graph makes it, as the op path's server makes it on its first write (zeroed).
                dtype = dtype_from_code(code)
                numel = nbytes // dtype.itemsize
                slot = emit(["aten::empty.memory_format", [[numel]], {"dtype": dtype, "device": torch_device}])
                found = producers[sid] = (slot, -1, (sid, code, (numel,), (1,), 0, nbytes))
            return found

        def ref(leaf: _Tensor) -> Ref:
            desc = leaf.desc
            sid = desc[0]
            if sid < capture.watermark or not sid:
                return Ref(input_slots[desc])
            slot, item, base = produced(sid, desc[5], desc[1])
            if desc[1:5] == base[1:5]:
                return Ref(slot, item)
            if desc[1] != base[1]:
                raise GraphCaptureError(f"a tensor views storage {sid} with dtype {dtype_from_code(desc[1])}, made "
                                        f"as {dtype_from_code(base[1])}: a captured graph cannot express that view")
            view = views.get(desc)
            if view is None:
                view = views[desc] = Ref(emit(["aten::as_strided", [Ref(slot, item), list(desc[2]), list(desc[3]),
                                                                     desc[4]], {}]))
            return view

        def arg(value: Any) -> Any:
            if isinstance(value, _Tensor):
                return ref(value)
            if isinstance(value, _Host):
                return Ref(input_slots[id(value)])
            if isinstance(value, list):
                return [arg(v) for v in value]
            return value

        for name, args, kwargs, outs in capture.ops:  # pass 2: the nodes
            node_args, node_kwargs = arg(args), {k: arg(v) for k, v in kwargs.items()}
            slot = emit([name, node_args, node_kwargs])
            items = _items(name, len(outs)) if any(o is not None for o in outs) else []
            for item, out in zip(items, outs, strict=False):
                if out is not None and out[0] >= capture.watermark and out[0] not in producers:
                    producers[out[0]] = (slot, item, out)
        # Outputs: the storages made during the capture that something besides the capture still holds.
        self.outputs: list[Ref] = []
        self.out_descs: list[Any] = []
        self.kept: dict[int, torch.UntypedStorage] = {}
        for sid, storage in capture.storages.items():
            if sid < capture.watermark:
                self.kept[sid] = storage  # an input: kept for the graph's life (a replay names it)
                continue
            if torch._C._storage_Use_Count(storage._cdata) <= 1:
                continue  # an intermediate: dropped now (its free reaches a node that never made it)
            # one made by torch.empty and never used by an op: bytes, made by the graph
            slot, item, desc = produced(sid, storage.nbytes(), DTYPES.index(torch.uint8))
            self.outputs.append(Ref(slot, item))
            self.out_descs.append(_tensor_ext(desc))
            self.kept[sid] = storage


def _leaves(value: Any) -> Any:
    if isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


class RemoteGraph:
    """What torch.accelerator.Graph calls on ``remote_accelerator`` (through genie._C's registered implementation)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self.number = next(_graph_numbers)
        self.debug = False
        self._capture: Capture | None = None
        self._built: _Built | None = None
        self._device: RemoteDevice | None = None
        self._gid: int | None = None
        self._conn: Any = None
        self._command: bytes | None = None
        self._lock = threading.Lock()
        #: replays sent (for tests and tools)
        self.replays = 0

    # -- capture -----------------------------------------------------------------------------------
    def capture_begin(self, pool: tuple[int, int] = (0, 0), mode: int = 0) -> None:
        if self._capture is not None or self._built is not None:
            raise GraphCaptureError("this graph already holds a capture; call reset() before capturing again")
        device = registry.table().get(None)
        conn = device.connection
        with conn.lock:
            if conn.capture is not None:
                raise GraphCaptureError(f"another graph is already capturing on {device.label}")
            conn._pull()  # what genie._C queued natively before the capture stays outside it
            capture = Capture(device)
            conn.capture = capture
            _C.queue_room(conn.qid, 0, 0)  # every op through Python while capturing (see NodeConnection._room)
        self._capture = capture
        self._device = device

    def capture_end(self) -> None:
        capture = self._capture
        if capture is None:
            raise GraphCaptureError("capture_end() without capture_begin()")
        device = capture.device
        conn = device.connection
        with conn.lock:
            conn.capture = None
            conn._room()
        self._capture = None
        if capture.error is not None:
            raise GraphCaptureError(f"the capture on {device.label} was invalidated: {capture.error}")
        if not capture.ops:
            log.warning("genie: a torch.accelerator.Graph on %s captured no op", device.label)
        self._built = _Built(capture)
        self._generators = list(capture.generators.values())
        del capture  # the intermediates' storages go now: only the outputs and inputs stay held
        log.debug("graph %d: %d nodes, %d inputs, %d outputs on %s", self.number, len(self._built.nodes),
                  len(self._built.inputs), len(self._built.outputs), device.label)
        if not self.keep_graph:
            self.instantiate()

    # -- definition and replay ------------------------------------------------------------------------
    def instantiate(self) -> None:
        """Define the graph on the node (one round trip; the node validates it) and pack its replay command."""
        built, device = self._built, self._device
        if built is None or device is None:
            raise GraphCaptureError("instantiate() needs a captured graph: capture it first")
        with self._lock:
            conn = device.connection
            if self._conn is conn and self._gid is not None:
                return
            gid = next(_graph_ids)
            default = dispatch.encoder_for(device)
            blob = encode_definition(len(built.inputs), built.nodes, built.outputs, default)
            conn._request([wm.CMD_GRAPH, 0, device.local_index, gid, blob], device=device.label)
            self._command = msgpack.packb([wm.CMD_REPLAY, device.local_index, gid, built.inputs, built.out_descs],
                                          use_bin_type=True, default=default)
            self._gid, self._conn = gid, conn

    def replay(self) -> None:
        device = self._device
        if self._built is None or device is None:
            raise GraphCaptureError("replay() needs a captured graph: capture it first")
        if self._conn is not device.connection or self._command is None:
            self.instantiate()
        for g in self._generators:
            dispatch._seed_if_needed(device, g)
        conn = device.connection
        assert self._command is not None
        conn.queue(self._command)
        # A replay is a whole step's work: send it now, so the node runs it while this process goes on.
        conn.flush()
        self.replays += 1

    def reset(self) -> None:
        if self._capture is not None:
            conn = self._capture.device.connection
            with conn.lock:
                if conn.capture is self._capture:
                    conn.capture = None
                    conn._room()
        self._capture = self._built = None
        self._gid = self._conn = self._command = None

    def pool(self) -> tuple[int, int]:
        return (0, self.number)

    def enable_debug_mode(self) -> None:
        self.debug = True

    def debug_dump(self, path: str) -> None:
        """Write the captured graph as text: one line per input and per node."""
        if not self.debug:
            raise GraphCaptureError("debug_dump() needs enable_debug_mode() before the capture")
        built = self._built
        if built is None:
            raise GraphCaptureError("debug_dump() needs a captured graph")
        with open(path, "w", encoding="utf-8") as f:
            for i, value in enumerate(built.inputs):
                f.write(f"%{i} = input {'descriptor' if isinstance(value, msgpack.ExtType) else 'host scalar'}\n")
            for i, node in enumerate(built.nodes):
                f.write(f"%{len(built.inputs) + i} = {node[0]}{tuple(node[1])!r:.300} {node[2]!r:.200}\n")
            f.write(f"outputs {built.outputs!r}\n")


class Graph(RemoteGraph):
    """``genie.Graph``: the same capture as ``torch.accelerator.Graph`` on ``remote_accelerator``, on any torch (a torch
    older than 2.13 has no accelerator graph registry to serve that class through)::

        g = genie.Graph()
        with g:                 # capture on the current remote device: nothing runs, nothing is sent
            static_loss = train_step(static_x)
        g.replay()              # one CMD_REPLAY

    An exception inside the ``with`` block ends the capture and leaves the graph empty (``reset``)."""

    def __enter__(self) -> Graph:
        self.capture_begin()
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None:
            self.reset()
            return
        self.capture_end()


def install() -> None:
    """Register :class:`RemoteGraph` as ``remote_accelerator``'s torch.accelerator.Graph implementation (torch
    2.13 and later; an older torch has no graph registry, and torch.accelerator.Graph is then not served)."""
    register = getattr(_C, "register_graph_impl", None)
    if register is None:
        log.debug("torch %s has no accelerator graph registry: torch.accelerator.Graph is not served", torch.__version__)
        return
    register(RemoteGraph)
