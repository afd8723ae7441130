"""Replaying a lowered graph: one ``CMD_REPLAY`` per call, outputs allocated on the client.

Per input signature (each remote input's dtype, sizes, strides, offset, storage size and which
inputs share a storage; CPU inputs' metadata; numbers by value) the client runs the FX graph
once on meta tensors. That run gives every output's layout and what it aliases (an input's
storage, or a storage shared with other outputs), and the values of the graph's client
scalars. The result is a :class:`Plan`, cached; a call then costs a signature, the outputs'
allocation (new storage ids, no round trip) and one command.

A graph is defined on a connection the first time it runs there (or at compile time), one
round trip; a reconnected session gets it again. A signature the meta run cannot handle (a
data-dependent op, a view that changes dtype, a large CPU input) runs that call op by op,
logged once per graph and reason.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any

import msgpack
import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from genie import _C
from genie.compile.lower import Lowered
from genie.device import dispatch, registry, shadows
from genie.device import meta as dmeta
from genie.device.connection import NodeConnection
from genie.device.registry import RemoteDevice
from genie.wire import messages as wm
from genie.wire.graph import encode_definition
from genie.wire.values import EXT_TENSOR, MAX_INLINE_TENSOR_BYTES

log = logging.getLogger("genie.compile")

#: Graph ids: unique in the process, so unique in every session.
_graph_ids = itertools.count(1)
#: Process-wide tallies (graphs defined on servers, calls replayed, calls run op by op), for tests and tools.
counts = {"defined": 0, "replayed": 0, "op_by_op": 0}
#: Plans kept per graph (one per input signature); a graph called with ever new shapes starts over.
MAX_PLANS = 64


class Plan:
    """What one input signature needs: the client scalars' values and how to make each output."""

    __slots__ = ("allocation", "outputs", "reason", "scalars")

    def __init__(self, scalars: list[Any], outputs: list[tuple[Any, ...]], reason: str | None = None) -> None:
        self.scalars = scalars
        #: per output: ("value", v) | ("input", pos, sizes, strides, offset)
        #: | ("fresh", group, dtype, sizes, strides, offset, storage_nbytes)
        self.outputs = outputs
        #: why this signature runs op by op (None: it is replayed)
        self.reason = reason
        #: the outputs' allocation steps (made on the first replay, see _allocation)
        self.allocation: list[tuple[Any, ...]] | None = None


def _fallback(reason: str) -> Plan:
    return Plan([], [], reason)


#: Byte length of a msgpack unsigned int by its first byte (uint8/16/32/64); a fixint is one byte.
_UINT_LENGTH = {0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9}


def _signature(inputs: list[Any]) -> tuple[tuple[Any, ...], int, list[Any]] | None:
    """The cache key of a call's inputs, its remote device's index (-1: none) and the inputs as the command
    carries them (remote tensors as their tensor tags); None if devices mix.

    A remote tensor's tag is the msgpack of its descriptor ``[storage_id, dtype, sizes, strides, offset,
    storage_nbytes]``, made once in C++: its bytes after the storage id are the layout part of the key
    (the server's codec caches layouts by the same bytes), the id only says which inputs share a storage.
    """
    sig: list[Any] = []
    encoded: list[Any] = []
    device = -1
    groups: dict[bytes, int] = {}
    for x in inputs:
        if isinstance(x, torch.Tensor):
            d = x.get_device()
            if d >= 0:
                if device >= 0 and d != device:
                    return None
                device = d
                payload = _C.wire_ext_payload(x)
                first = payload[1]  # payload[0] is the fixarray header
                end = 2 if first < 0x80 else 1 + _UINT_LENGTH[first]
                sid = payload[1:end]
                group = groups.setdefault(sid, len(groups)) if first else -1  # id 0: an empty storage of its own
                sig.append((payload[end:], group, x.is_conj() or x.is_neg()))
                encoded.append(_new_tuple(msgpack.ExtType, (EXT_TENSOR, payload)))
                continue
            sig.append(("C", x.dtype, x.shape, x.stride(), x.storage_offset()))
        else:
            sig.append((type(x), x))
        encoded.append(x)
    return tuple(sig), device, encoded


_new_tuple = tuple.__new__


def _meta_inputs(inputs: list[Any]) -> tuple[list[Any], dict[int, int]]:
    """Meta stand-ins of the inputs (inputs sharing a storage share a meta storage), and meta storage -> input."""
    storages: dict[int, Any] = {}
    owner: dict[int, int] = {}
    out: list[Any] = []
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.get_device() >= 0:
            sid = _C.storage_id(x)
            nbytes = x.untyped_storage().nbytes()
            storage = storages.get(sid) if sid else None
            if storage is None:
                storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
                if sid:
                    storages[sid] = storage
            owner.setdefault(storage._cdata, i)
            out.append(torch.empty(0, dtype=x.dtype, device="meta").set_(storage, x.storage_offset(), x.shape,
                                                                       x.stride()))
        else:
            out.append(x)
    return out, owner


def _run_meta(gm: fx.GraphModule, lowered: Lowered, inputs: list[Any], kind: str) -> Plan:
    """Run the graph on meta tensors: the outputs' layouts and aliasing, and the client scalars; ``kind``: the
    server device's (the layouts some ops return depend on it, as on the op path)."""
    metas, owner = _meta_inputs(inputs)
    env: dict[fx.Node, Any] = {}
    args_iter = iter(metas)
    constants = iter(metas[lowered.placeholders:])
    result: Any = None
    with torch.no_grad():
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(args_iter)
            elif n.op == "get_attr":
                env[n] = next(constants)  # the constants follow the placeholders, in graph order
            elif n.op == "call_function":
                # Factories name the remote device: on meta they must make meta tensors (as the op path's meta does).
                args = tree_map(dispatch._to_meta_arg, fx.node.map_arg(n.args, env.__getitem__))
                kwargs = tree_map(dispatch._to_meta_arg, fx.node.map_arg(n.kwargs, env.__getitem__))
                try:
                    out = n.target(*args, **kwargs)
                except (NotImplementedError, RuntimeError) as exc:
                    return _fallback(f"{n.name} ({n.target}) has no usable meta kernel: {str(exc)[:200]}")
                by_kind = dispatch.KIND_FIXUPS.get(n.target)
                if by_kind is not None and kind in by_kind:
                    out = _fixed(out, by_kind[kind], args, kwargs)
                env[n] = out
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
    scalars = [env[n] for n in lowered.scalar_nodes]
    outputs: list[tuple[Any, ...]] = []
    groups: dict[int, tuple[int, torch.dtype]] = {}
    for value in result:
        if not isinstance(value, torch.Tensor):
            outputs.append(("value", value))
            continue
        if not value.is_meta:
            return _fallback(f"an output is a {value.device} tensor, not one of the remote device")
        storage = value.untyped_storage()
        key = storage._cdata
        layout = (tuple(value.shape), tuple(value.stride()), value.storage_offset())
        if key in owner:
            pos = owner[key]
            if inputs[pos].dtype != value.dtype:
                return _fallback(f"an output views input {pos} with another dtype")
            outputs.append(("input", pos, *layout))
            continue
        group = groups.get(key)
        if group is None:
            group = groups[key] = (len(groups), value.dtype)
        elif group[1] != value.dtype:
            return _fallback("two outputs view one storage with different dtypes")
        if storage.nbytes() % value.element_size():
            return _fallback(f"an output's storage of {storage.nbytes()} bytes is not whole {value.dtype} elements")
        outputs.append(("fresh", group[0], value.dtype, *layout, storage.nbytes()))
    return Plan(scalars, outputs)


def _fixed(out: Any, fixup: Any, args: Any, kwargs: Any) -> Any:
    """Apply a :data:`genie.device.dispatch.KIND_FIXUPS` rule (where meta and the real kernels disagree)."""
    metas, spec = dmeta.describe(out)
    fixed = fixup(metas, args, kwargs)
    if fixed == metas:
        return out
    flat, _ = tree_flatten(out)
    rebuilt = [o if m is None else torch.empty_strided(m[1], m[2], dtype=m[0], device="meta")
               for o, m in zip(flat, fixed, strict=True)]
    return tree_unflatten(rebuilt, spec)


def _allocation(plan: Plan) -> list[tuple[Any, ...]]:
    """How :func:`_allocate` makes each output, worked out once per plan: ("value", v) | ("input", pos, sizes,
    strides, offset) | ("fresh", group, dtype, numel, how, sizes, strides, offset) with ``how`` 0 for the
    base itself, 1 for a view of it, 2 for a strided view."""
    steps: list[tuple[Any, ...]] = []
    for spec in plan.outputs:
        if spec[0] != "fresh":
            steps.append(spec)
            continue
        _, group, dtype, sizes, strides, offset, nbytes = spec
        numel = nbytes // dtype.itemsize
        how = 2
        if offset == 0 and numel == dmeta.storage_numel(sizes, strides, 0) \
                and strides == tuple(dispatch.contiguous_strides(sizes)):
            how = 0 if len(sizes) == 1 and sizes[0] == numel else 1
        steps.append(("fresh", group, dtype, numel, how, sizes, strides, offset))
    return steps


def _allocate(plan: Plan, inputs: list[Any], index: int) -> tuple[list[Any], list[Any]]:
    """The call's outputs and their tensor tags (None for numbers)."""
    outs: list[Any] = []
    descs: list[Any] = []
    bases: dict[int, torch.Tensor] = {}
    device = dispatch.torch_device(index)
    steps = plan.allocation
    if steps is None:
        steps = plan.allocation = _allocation(plan)
    as_strided = torch.ops.aten.as_strided.default
    payload = _C.wire_ext_payload
    for spec in steps:
        kind = spec[0]
        if kind == "value":
            outs.append(spec[1])
            descs.append(None)
            continue
        if kind == "input":
            _, pos, sizes, strides, offset = spec
            t = as_strided(inputs[pos], sizes, strides, offset)
        else:
            _, group, dtype, numel, how, sizes, strides, offset = spec
            base = bases.get(group)
            if base is None:
                base = bases[group] = torch.empty(numel, dtype=dtype, device=device)
            t = base if how == 0 else base.view(sizes) if how == 1 else as_strided(base, sizes, strides, offset)
        outs.append(t)
        descs.append(_new_tuple(msgpack.ExtType, (EXT_TENSOR, payload(t))))
    return outs, descs


class ReplayedGraph:
    """The compiled function AOTAutograd calls (boxed: it takes one list of inputs)."""

    def __init__(self, gm: fx.GraphModule, lowered: Lowered, name: str) -> None:
        # An instance attribute: dynamo's disable() wrapper copies __dict__, so the backward stays boxed too.
        self._boxed_call = True
        self.gm = gm
        self.lowered = lowered
        self.name = name
        self.plans: dict[Any, Plan] = {}
        self._ids: weakref.WeakKeyDictionary[NodeConnection, dict[int, int]] = weakref.WeakKeyDictionary()
        self._logged: set[str] = set()
        self._definition: dict[int, bytes] = {}
        #: calls replayed and calls run op by op (for tests and genie.stats readers)
        self.replayed = 0
        self.op_by_op = 0

    # -- definition --------------------------------------------------------------------------
    def graph_id(self, device: RemoteDevice) -> int:
        """This graph's id on ``device``'s session, defining it there first (one round trip)."""
        conn = device.connection
        ids = self._ids.get(conn)
        if ids is None:
            ids = self._ids[conn] = {}
        gid = ids.get(device.local_index)
        if gid is None:
            gid = next(_graph_ids)
            low = self.lowered
            blob = encode_definition(low.inputs, low.nodes, low.outputs, dispatch.encoder_for(device))
            conn._request([wm.CMD_GRAPH, 0, device.local_index, gid, blob], device=device.label)
            ids[device.local_index] = gid
            counts["defined"] += 1
            log.debug("%s defined on %s as graph %d (%d nodes)", self.name, device.label, gid, len(low.nodes))
        return gid

    # -- calls -------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        if len(args) == 1 and type(args[0]) is list:  # boxed: graph inputs are tensors and numbers, never lists
            inputs = list(args[0])
            args[0].clear()  # the boxed convention: inputs may be freed once the graph no longer needs them
        else:  # AOTAutograd calls a backward wrapped by dynamo's disable() (which hides _boxed_call) unboxed
            inputs = list(args)
        found = _signature(inputs)
        plan = None
        if found is None:
            plan = _fallback("its inputs are on several remote devices")
        elif found[1] < 0:
            plan = _fallback("none of its inputs is on a remote device")
        else:
            # The server device's kind is part of the key: some ops' outputs differ by it (KIND_FIXUPS).
            device = registry.device_at(found[1])
            plan = self.plans.get((device.kind, found[0]))
            if plan is None:
                plan = self._plan((device.kind, found[0]), inputs)
        if plan.reason is not None:
            self._note(plan.reason)
            self.op_by_op += 1
            counts["op_by_op"] += 1
            return self.gm(*inputs)
        assert found is not None
        return self._replay(plan, inputs, device, found[2])

    def _plan(self, key: tuple[str, Any], inputs: list[Any]) -> Plan:
        """The plan of a new key, (the server device's kind, the inputs' signature)."""
        for i, x in enumerate(inputs):
            if i in self.lowered.mutated and isinstance(x, torch.Tensor) and x.get_device() < 0:
                plan = _fallback(f"it writes to input {i}, a CPU tensor (the server would write only its copy; "
                                 "keep such state on the device, e.g. torch.optim's capturable=True)")
                break
            if isinstance(x, torch.Tensor) and x.get_device() < 0 and x.nbytes > MAX_INLINE_TENSOR_BYTES:
                plan = _fallback(f"a CPU input of {x.nbytes} bytes is too large to send with each call")
                break
            if isinstance(x, torch.Tensor) and x.get_device() >= 0 and (x.is_conj() or x.is_neg()):
                plan = _fallback("an input carries a conjugate or negative bit")
                break
        else:
            plan = _run_meta(self.gm, self.lowered, inputs + list(self.lowered.constants), key[0])
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    def _replay(self, plan: Plan, inputs: list[Any], device: RemoteDevice, encoded: list[Any]) -> Any:
        if device.connection.capture is not None:
            raise device.connection.capture.refuse(f"{self.name} (a torch.compile(backend='genie') graph)")
        index = device.index
        gid = self.graph_id(device)
        constants = self.lowered.constants
        outs, descs = _allocate(plan, [*inputs, *constants] if constants else inputs, index)
        if self.lowered.random:
            dispatch._seed_if_needed(device, None)
        values = [*encoded, *constants, *plan.scalars]
        shadows.forget_tensors(inputs)  # a graph may write any of its inputs: no host shadow of one stays
        cmd = msgpack.packb([wm.CMD_REPLAY, device.local_index, gid, values, descs], use_bin_type=True,
                            default=dispatch.encoder_for(device))
        conn = device.connection
        conn.queue(cmd)
        # A replay is a whole graph's work: send it now, so the server runs it while this process goes on
        # (queued, it would wait for the batch to fill or for the next sync, and the two sides would take turns).
        conn.flush()
        self.replayed += 1
        counts["replayed"] += 1
        return tuple(outs) if self.lowered.returns_tuple else outs

    def _note(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("genie: a call of %s runs op by op: %s", self.name, reason)
