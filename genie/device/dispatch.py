"""The PrivateUse1 fallback: every aten op on ``remote_accelerator`` that C++ does not answer.

Remote tensors are ordinary tensors whose storage is a number (a *storage id*, see
``genie/csrc/device/allocator.h``). For an op the fallback

1. finds the one device its tensors live on (mixing devices fails like CUDA),
2. gets the outputs' dtype/sizes/strides/offset from meta tensors (cached per signature),
3. makes the outputs locally: fresh ones through the allocator (new storage ids, no round
   trip), views over their base's storage, in-place/out= results are the argument itself,
4. queues ``[CMD_OP, device, op, args, kwargs, outs]`` fire-and-forget, unless every output
   is a view (the server needs nothing: descriptors carry views).

Ops whose result only the server can know (numbers, data-dependent shapes) are a round trip
(CMD_CALL). Copies, ``resize_`` and ``set_`` have their own rules in :mod:`genie.device.copies`.
"""

from __future__ import annotations

import functools
from typing import Any

import msgpack
import torch
from torch.utils._pytree import tree_map, tree_unflatten

from genie import _C
from genie.device import arguments, registry, shadows
from genie.device import meta as dmeta
from genie.device.registry import RemoteDevice, table
from genie.errors import DeviceError
from genie.wire import messages as wm
from genie.wire.floats import floats_decide_metadata
from genie.wire.values import (
    EXT_TENSOR,
    device_ext,
    dtype_from_code,
    encode_common,
    generator_ext,
    inline_tensor,
)

BACKEND = "remote_accelerator"
_aten = torch.ops.aten
_devices: dict[int, torch.device] = {}


def torch_device(index: int) -> torch.device:
    """The cached ``torch.device`` of ``remote_accelerator:index``."""
    d = _devices.get(index)
    if d is None:
        d = _devices[index] = torch.device(BACKEND, index)
    return d


#: ``[storage_id, dtype code, sizes, strides, offset, storage_nbytes]`` of a remote tensor (one C++ call).
descriptor = _C.wire_desc


# -- per-op facts, computed once ------------------------------------------------------------------
class OpInfo:
    """What the fallback needs to know about an op's schema."""

    __slots__ = ("name", "arg_names", "returns", "generator_pos", "random", "mask_pos", "list_return", "all_views",
                 "special", "server", "float_values_matter", "result_kinds", "by_kind", "shadow")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.name: str = func.name()
        self.arg_names = tuple(a.name for a in schema.arguments)
        #: its own rule (genie.device.copies; genie.device.arguments for numbers where a Tensor goes, CPU
        #: indices, sparse and quantized layouts), or None
        self.special = SPECIAL.get(func) or arguments.special_for(self.name, schema, run_op)
        #: only the server can answer it (numbers, data-dependent shapes): a round trip
        self.server = func in SERVER_OPS
        #: metadata rules by the server device's kind (KIND_FIXUPS), or None: the meta cache keys on the kind then
        self.by_kind: dict[str, Any] | None = KIND_FIXUPS.get(func)
        #: what host shadows need to know (the arguments it writes, whether it can run on shadows), or None
        self.shadow = shadows.rule_of(func)
        writes: dict[Any, int] = {}
        reads: dict[Any, int] = {}
        self.generator_pos: int | None = None
        self.mask_pos: int | None = None
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None:
                for s in a.alias_info.before_set:
                    (writes if a.alias_info.is_write else reads)[s] = i
            if "Generator" in str(a.type):
                self.generator_pos = i
            if a.name in ("output_mask", "grad_input_mask"):  # masked-off outputs are undefined tensors
                self.mask_pos = i
        #: draws random numbers (with its generator argument, or the device's default one)
        self.random = self.generator_pos is not None or self.name in RANDOM_WITHOUT_GENERATOR
        #: per return: ("inplace", arg position) | ("view", arg position) | ("fresh", None)
        self.returns: list[tuple[str, int | None]] = []
        self.list_return = False
        for r in schema.returns:
            kind: tuple[str, int | None] = ("fresh", None)
            if r.alias_info is not None:
                for s in r.alias_info.before_set:
                    if r.alias_info.is_write and s in writes:
                        kind = ("inplace", writes[s])
                    elif s in reads or s in writes:
                        kind = ("view", reads.get(s, writes.get(s)))
            if "[]" in str(r.type) or "List[" in str(r.type):
                self.list_return = True
            self.returns.append(kind)
        self.all_views = bool(self.returns) and all(k == "view" for k, _ in self.returns)
        #: per return, how a round trip's reply describes it: "list" of tensors, one "tensor", or a plain value
        self.result_kinds = tuple(
            "list" if str(r.type).startswith(("Tensor[]", "List[Tensor]"))
            else "tensor" if str(r.type).startswith("Tensor") else "value" for r in schema.returns)
        #: whether float argument values can change the outputs' metadata (then the meta cache keys them
        #: by value; else by type, so AdamW's lr and bias corrections, new every step, still hit the cache)
        self.float_values_matter = floats_decide_metadata(self.name, schema)

    def kind_of(self, i: int) -> tuple[str, int | None]:
        if self.list_return:  # a list return flattens into many outputs of one kind
            return self.returns[0] if len(self.returns) == 1 else ("fresh", None)
        return self.returns[i] if i < len(self.returns) else ("fresh", None)


#: Random ops with no generator argument: the server draws from the session's default generator.
#: The fused attention op draws only when dropout_p > 0, but is marked random whatever its dropout_p: the seed must
#: reach the server before it, and the C++ fast path (never taught random ops) cannot tell the calls apart.
RANDOM_WITHOUT_GENERATOR = frozenset({"aten::native_dropout", "aten::_scaled_dot_product_fused_attention_overrideable"})

#: id(op) -> OpInfo. Keyed by id: OpOverloads are process-lifetime singletons whose __hash__ is Python code.
_infos: dict[int, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _infos.get(id(func))
    if info is None:
        info = _infos[id(func)] = OpInfo(func)
    return info


# -- finding the device ---------------------------------------------------------------------------
def scan(args: Any, state: list[Any]) -> tuple[Any, ...]:
    """The cache signature of ``args`` (a list or tuple), noting in ``state`` the remote device seen
    (``state[0]``, -1 for none yet) and whether a CPU tensor with dimensions was (``state[1]``);
    ``state[3]`` says whether float values are part of the signature; ``state[4]`` is set when a tensor
    carries a conjugate or negative bit.

    One pass serves both the meta cache and the device check: this is the per-op hot path.
    """
    out: list[Any] = []
    for a in args:
        t = type(a)
        if t is torch.Tensor or isinstance(a, torch.Tensor):
            if a.is_conj() or a.is_neg():
                state[4] = True  # the op's arguments need _resolved (rare: skipped otherwise)
            d = a.get_device()
            if d >= 0:
                if d != state[0]:
                    if state[0] >= 0:
                        raise RuntimeError(
                            f"Expected all tensors to be on the same device, but found at least two devices, "
                            f"{BACKEND}:{state[0]} and {BACKEND}:{d}! (when checking arguments for {state[2]})")
                    state[0] = d
                out.append((a.dtype, a.shape, a.stride(), a.storage_offset()))
            else:
                if a.dim() and not a.is_meta:
                    state[1] = True
                out.append(("C", a.dtype, a.shape))
        elif t is list or t is tuple:
            out.append(scan(a, state))
        elif t is float:
            # By type unless this op's float values can change its outputs' metadata (OpInfo.float_values_matter).
            out.append((t, a) if state[3] else t)
        elif t is bool:
            out.append((t, a))
        elif t is torch.device:
            if a.type == BACKEND:
                d = table().get(a.index).index
                if state[0] >= 0 and d != state[0]:
                    raise RuntimeError(
                        f"Expected all tensors to be on the same device, but found at least two devices, "
                        f"{BACKEND}:{state[0]} and {BACKEND}:{d}! (when checking arguments for {state[2]})")
                state[0] = d
            out.append(("D", a.type))
        elif t is torch.Generator:
            out.append(("G",))
        else:
            out.append(a)
    return tuple(out)


def signature_and_device(name: str, args: Any, kwargs: Any, float_values: bool = True) -> tuple[Any, int, bool]:
    """(cache signature of args and kwargs, global index of the one remote device they use, whether a
    tensor argument has a math bit).

    ``float_values``: key float arguments by value (else by type only)."""
    state: list[Any] = [-1, False, name, float_values, False]
    sig = scan(args, state)
    if kwargs:
        sig = (sig, tuple(kwargs), scan(kwargs.values(), state))
    found = state[0]
    if found < 0:
        raise DeviceError(f"{name} reached the remote device without a remote tensor or device argument")
    if state[1]:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{BACKEND}:{found} and cpu! (when checking arguments for {name})"
        )
    return sig, found, state[4]


# -- the argument encoder -------------------------------------------------------------------------
_new_tuple = tuple.__new__

def encoder_for(device: RemoteDevice) -> Any:
    """The msgpack ``default`` of one session (built once per connection)."""
    conn = device.connection
    cached = conn.encoder
    if cached is not None:
        return cached

    def default(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.get_device() >= 0:
                # tuple.__new__ skips ExtType's argument checks (a Python __new__): the code is ours, the
                # payload bytes from C++; the packer reads .code and .data only.
                return _new_tuple(msgpack.ExtType, (EXT_TENSOR, _C.wire_ext_payload(obj)))
            return inline_tensor(obj)
        if isinstance(obj, torch.Generator):
            return generator_ext(_C.generator_info(obj)[0])
        if isinstance(obj, torch.device):
            if obj.type != BACKEND:
                raise DeviceError(f"a {obj} device argument cannot be sent to a remote device")
            target = table().get(obj.index)
            if target.connection is not conn:
                raise DeviceError(f"{target.label} is on another node than this op's device")
            return device_ext(target.local_index)
        encoded = encode_common(obj)
        if encoded is NotImplemented:
            raise DeviceError(f"genie cannot send a {type(obj).__name__} argument to the server")
        return encoded

    conn.encoder = default
    return default


# -- meta arguments -------------------------------------------------------------------------------
def _to_meta_arg(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.get_device() >= 0:
        return dmeta.to_meta(obj)
    if isinstance(obj, torch.device) and obj.type == BACKEND:
        return torch.device("meta")
    if isinstance(obj, torch.Generator):
        return None
    return obj


_meta_cache = dmeta.MetaCache()
_cache_get = _meta_cache._cache.get  # the per-op path skips the method call (and the hit counter)


def meta_cache() -> dmeta.MetaCache:
    return _meta_cache


# -- the fallback -----------------------------------------------------------------------------------
def fallback(func: Any, *args: Any, **kwargs: Any) -> Any:
    """The PrivateUse1 fallback kernel (registered by :mod:`genie.device.registration`)."""
    info = _infos.get(id(func)) or op_info(func)
    if info.special is not None:
        return info.special(func, args, kwargs)
    return run_op(func, args, kwargs, info)


def run_op(func: Any, args: Any, kwargs: Any, info: OpInfo | None = None, teach: bool = True) -> Any:
    """The common path: meta inference (cached), local outputs, one fire-and-forget command.

    ``teach``: genie._C may learn the call (False where the arguments sent are not the ones it was given)."""
    if info is None:
        info = op_info(func)
    sig, index, math_bits = signature_and_device(info.name, args, kwargs, info.float_values_matter)
    device = registry.device_at(index)
    if info.server:
        return call_on_server(func, args, kwargs, device)
    key: Any = (id(func), sig) if info.by_kind is None else (id(func), sig, device.kind)
    try:
        cached = _cache_get(key)
    except TypeError:  # an unhashable argument: no caching
        key, cached = None, None
    if cached is None:
        arguments.check_layouts(info.name, args, kwargs)
        try:
            metas, spec, flat = _run_meta(func, args, kwargs)
        except dmeta.NeedsServer:
            return call_on_server(func, args, kwargs, device)
        values = [None if isinstance(o, torch.Tensor) else o for o in flat]
        if info.by_kind is not None and device.kind in info.by_kind:
            metas = info.by_kind[device.kind](metas, args, kwargs)
        # Whether an in-place/out= target must change layout: the signature holds the target's
        # layout, so the answer holds for every later call with the same signature.
        conform = [m is not None and info.kind_of(i)[0] == "inplace"
                   and _differs(_target(info, i, args, kwargs), m) for i, m in enumerate(metas)]
        kinds = [info.kind_of(i) for i in range(len(metas))]
        cached = (metas, spec, values, conform, len(metas) == 1 and spec.is_leaf(), kinds)
        if key is not None:
            _meta_cache.store(key, cached)
    metas, spec, values, conform, leaf, kinds = cached
    if info.mask_pos is not None:  # backward ops skip masked-off outputs (undefined tensors); meta does not
        mask = _arg(info, info.mask_pos, args, kwargs)
        metas = [m if i >= len(mask) or mask[i] else None for i, m in enumerate(metas)]
    outs: list[Any] = []
    wire_outs: list[Any] = []
    send = not info.all_views
    grown: list[int] = []  # out= targets that arrived without a storage (no bytes, no id) and were given one
    for i, m in enumerate(metas):
        if m is None:
            outs.append(values[i])
            # An undefined tensor (a masked-off gradient, the fused attention's cum_seq_q) is a nil on the wire,
            # as genie._C's fast path sends it and the server's output rule counts it; numbers are not sent.
            if values[i] is None or info.mask_pos is not None and i < len(info.returns):
                wire_outs.append(None)
            continue
        kind, pos = kinds[i]
        if kind == "inplace":
            out = _target(info, i, args, kwargs)
            if conform[i]:
                if not out.untyped_storage().nbytes() and not _C.storage_id(out):
                    grown.append(i)
                set_layout(out, m[1], m[2], m[3])
        elif kind == "view":
            base = _arg(info, pos, args, kwargs)
            if isinstance(base, (list, tuple)):
                base = base[0]
            out = _aten.as_strided.default(base, m[1], m[2], m[3])
            if m[0] != base.dtype:  # view_as_real & co. are C++ kernels; a dtype-changing view here is a bug
                raise DeviceError(f"{info.name}: a view that changes dtype reached the fallback")
        else:
            out = new_tensor(m, index)
        outs.append(out)
        if send:  # a tensor tag: the server decodes it through its cache of checked layouts
            wire_outs.append(_new_tuple(msgpack.ExtType, (EXT_TENSOR, _C.wire_ext_payload(out))))
    if send:
        if info.random:
            g = _arg(info, info.generator_pos, args, kwargs) if info.generator_pos is not None else None
            _seed_if_needed(device, g)
        if math_bits:
            targets = {id(o) for o in outs if isinstance(o, torch.Tensor)}
            args, kwargs = tree_map(lambda a: _resolved(a, targets), (args, kwargs))
        if device.connection.capture is not None:  # torch.accelerator.Graph capture holds the outputs (graphs.py)
            device.connection.capture.fresh(outs)
        device.connection.op(device.local_index, info.name, args, kwargs, wire_outs, encoder_for(device))
        rule = info.shadow
        if rule is not None and (rule.fills or shadows.TABLE.entries):
            shadows.after_op(func, rule, args, kwargs, outs)
        if key is not None and teach and not (info.random or math_bits or info.list_return) \
                and _C.fast_teaching(info.name):
            _teach(info, metas, values, conform, kinds, grown)
    if leaf:
        return outs[0]
    return tree_unflatten(outs, spec)


def _run_meta(func: Any, args: Any, kwargs: Any) -> tuple[list[Any], Any, list[Any]]:
    """The op on meta tensors; once more with its 0-dim CPU tensors as meta ones where a meta kernel took the
    first argument's device for the output (``torch.tensor(2.0) * x``: CUDA takes such a CPU scalar)."""
    try:
        return dmeta.run_meta(func, args, kwargs, _to_meta_arg)
    except RuntimeError as exc:
        if "device" not in str(exc) or not arguments.has_cpu_scalar(args, kwargs):
            raise
        return dmeta.run_meta(func, args, kwargs, functools.partial(arguments.meta_with_scalars,
                                                                    remote_to_meta=_to_meta_arg))


def _teach(info: OpInfo, metas: list[Any], values: list[Any], conform: list[bool], kinds: list[Any],
           grown: list[int]) -> None:
    """Teach genie._C this call's signature (genie/csrc/device/fastpath.cpp): its outputs, when it can answer
    the next call with the same signature alone (fresh or in-place outputs that keep their layout, and out=
    targets that arrive empty, without a storage id: ``grown``, which genie._C gives the same layout over a new
    storage id, as :func:`set_layout` did; it checks each later call's target is such a one)."""
    plan: list[tuple[Any, ...]] = []
    for i, m in enumerate(metas):
        if m is None:
            if values[i] is not None:
                return  # a number among the results: only Python knows it
            plan.append((2,))
            continue
        kind, pos = kinds[i]
        if kind == "inplace":
            if pos is None or pos >= len(info.arg_names):
                return
            if not conform[i]:
                plan.append((1, pos))
            elif i in grown:
                plan.append((3, pos, *_taught_layout(m)))
            else:
                return
        elif kind == "fresh":
            plan.append((0, *_taught_layout(m)))
        else:
            return
    _C.fast_learn(info.name, not info.float_values_matter, plan)


def _taught_layout(m: dmeta.OutMeta) -> tuple[Any, ...]:
    """An output's layout as genie._C.fast_learn reads it: (dtype, sizes, strides, offset, span in elements)."""
    dtype, shape, stride, offset = m
    return dtype, list(shape), list(stride), offset, dmeta.storage_numel(shape, stride, offset)


def overload_of(namespace: str, name: str, overload: str) -> Any:
    """The OpOverload of an operator the dispatcher names (genie._C's fallback calls Python with it)."""
    return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


def _arg(info: OpInfo, pos: int | None, args: Any, kwargs: Any) -> Any:
    assert pos is not None
    if pos < len(args):
        return args[pos]
    return kwargs.get(info.arg_names[pos])


def contiguous_strides(shape: Any) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return strides[::-1]


def new_tensor(m: dmeta.OutMeta, index: int) -> torch.Tensor:
    """A fresh tensor on ``remote_accelerator:index`` with the described layout (a new storage id)."""
    dtype, shape, stride, offset = m
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=dtype, device=torch_device(index))
    span = dmeta.storage_numel(shape, stride, offset)
    return torch.empty(span, dtype=dtype, device=torch_device(index)).as_strided(shape, stride, offset)


def _target(info: OpInfo, i: int, args: Any, kwargs: Any) -> torch.Tensor:
    """The argument an in-place/out= op's i-th (flattened) output is."""
    target = _arg(info, info.kind_of(i)[1], args, kwargs)
    return target[i] if isinstance(target, (list, tuple)) else target


def _differs(target: torch.Tensor, m: dmeta.OutMeta) -> bool:
    """Whether an in-place/out= target's layout differs from the op's output (``t_``, ``out=`` resizes)."""
    _, shape, stride, offset = m
    return not (tuple(target.shape) == shape and target.stride() == stride and target.storage_offset() == offset)


# -- generators -----------------------------------------------------------------------------------
_default_generators: dict[int, torch.Generator] = {}


def default_generator(index: int) -> torch.Generator:
    g = _default_generators.get(index)
    if g is None:
        g = _default_generators[index] = _C.default_generator(index)
    return g


def _seed_if_needed(device: RemoteDevice, generator: Any) -> None:
    """Send CMD_SEED before a random op when its generator was (re)seeded since the last one."""
    g = generator if generator is not None else default_generator(device.index)
    gid, seed, epoch = _C.generator_info(g)
    conn = device.connection
    key = (device.local_index, gid)
    if conn.seeded.get(key) != epoch:
        conn.seeded[key] = epoch
        if epoch:  # never seeded: the server's own random seed stands
            conn.command([wm.CMD_SEED, device.local_index, gid, seed])


# -- round trips ----------------------------------------------------------------------------------
def _resolved(a: Any, targets: set[int]) -> Any:
    """An input with a math bit, materialized on its device; anything else as it is.

    ATen's Conjugate/Negative keys fall through for ops whose CPU/CUDA kernels read the bits
    themselves (``mm``, ``addmm``, ``bmm``, ``dot`` and their ``out=`` forms), so those inputs reach
    this fallback with the bit set; the wire carries plain storages, so the bit is applied here
    (one remote op). Targets that get written keep their bit and are refused by the encoder.
    """
    if isinstance(a, torch.Tensor) and (a.is_conj() or a.is_neg()) and id(a) not in targets:
        return a.resolve_conj().resolve_neg()
    return a


def call_on_server(func: Any, args: Any, kwargs: Any, device: RemoteDevice) -> Any:
    """Run an op synchronously: data-dependent shapes and number results."""
    info = _infos.get(id(func)) or op_info(func)
    if shadows.TABLE.entries and device.connection.lost is None:
        known, value = shadows.server_op(info.name, args, kwargs)
        if known:
            return value
    count = 64 if info.list_return else len(info.returns)
    ids = [_C.new_storage_id() for _ in range(count)]
    result = device.connection.call(device.local_index, info.name, args, kwargs, ids, encoder_for(device),
                                    device=device.label)
    decoded = _decode_call_result(info, result, device)
    if info.shadow is not None and info.shadow.writes and shadows.TABLE.entries:
        shadows.after_op(func, shadows.Rule(info.shadow.writes, None, False), args, kwargs, [])
    if info.list_return or not any(kind == "inplace" for kind, _ in info.returns):
        return decoded
    return _into_targets(info, args, kwargs, decoded)


def _into_targets(info: OpInfo, args: Any, kwargs: Any, decoded: Any) -> Any:
    """An in-place/``out=`` op's results as its target arguments, as torch returns them.

    The server ran the op into the targets' storages and keeps each result (a copy) under a new id. A target
    whose layout the op kept holds the result already; one the op resized (``linalg_lstsq.out``'s empty
    outs) takes the result's storage (a metadata change here, no command)."""
    single = len(info.returns) == 1
    results = [decoded] if single else list(decoded)
    for i, (kind, pos) in enumerate(info.returns):
        if kind != "inplace" or i >= len(results):
            continue
        target, got = _arg(info, pos, args, kwargs), results[i]
        if not isinstance(target, torch.Tensor) or not isinstance(got, torch.Tensor) or got.dtype != target.dtype:
            continue
        if got.shape != target.shape or got.stride() != target.stride():
            _aten.set_.source_Storage_storage_offset(target, got.untyped_storage(), got.storage_offset(),
                                                     list(got.shape), list(got.stride()))
        results[i] = target
    return results[0] if single else tuple(results)


def _local_scalar(func: Any, args: Any, kwargs: Any) -> Any:
    """``.item()``, ``float(t)``, ``bool(t)``: the commonest sync point, so it skips the general path's
    signature and result decoding (one tensor in, one number out)."""
    t = args[0]
    device = registry.device_at(t.get_device())
    if shadows.TABLE.entries and device.connection.lost is None:
        known, value = shadows.item(t)
        if known:
            return value
    return device.connection.call(device.local_index, "aten::_local_scalar_dense", [t], {}, [_C.new_storage_id()],
                                  encoder_for(device), device=device.label)


def adopt(desc: Any, device: RemoteDevice) -> torch.Tensor:
    """A local tensor over a storage the server made (its size known only from the reply)."""
    sid, code, sizes, strides, offset, nbytes = desc
    return _C.make_tensor(sid, nbytes, device.index, dtype_from_code(code), sizes, strides, offset)


def _decode_call_result(info: OpInfo, result: Any, device: RemoteDevice) -> Any:
    kinds = info.result_kinds
    if not kinds:  # an op that returns nothing (``-> ()``: _fused_sgd_ without a meta kernel): None, as torch's own
        return None
    values = result if len(kinds) != 1 else [result]
    out: list[Any] = []
    for kind, v in zip(kinds, values, strict=False):
        if kind == "list":
            out.append([adopt(d, device) for d in v])
        elif kind == "tensor":
            out.append(adopt(v, device) if v is not None else None)
        else:
            out.append(v)
    return out[0] if len(kinds) == 1 else tuple(out)


#: Ops whose result is a number or a data-dependent shape: always a round trip.
SERVER_OPS = frozenset({
    _aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default,
    _aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default, _aten.unique_consecutive.default,
    _aten.unique_dim.default,
})

def _batch_norm_eval_cpu(metas: list[Any], args: Any, kwargs: Any, training: bool | None = None) -> list[Any]:
    """The CPU kernel's saved mean/invstd where the meta kernel answers as CUDA's does.

    Outside training the CPU kernel returns them empty (the meta kernel: one per channel, torch's
    decomposition notes the same split). For a float16/bfloat16 input the CPU kernel keeps them in the
    input's dtype unless a parameter or running statistic is float32 (its "mixed type"), where CUDA and the
    meta kernel always use float32 (found by the OpInfo gate: batch_norm in half precision)."""
    if training is None:
        training = args[5] if len(args) > 5 else kwargs.get("training")
    x = args[0] if args else kwargs.get("input")
    stat = metas[1][0]
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        given = [*args[1:5], *(kwargs.get(k) for k in ("weight", "bias", "running_mean", "running_var"))]
        mixed = any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in given)
        stat = torch.float32 if mixed else x.dtype
    if training:
        return [metas[0], (stat, *metas[1][1:]), (stat, *metas[2][1:]), *metas[3:]]
    empty = (stat, (0,), (1,), 0)
    return [metas[0], empty, empty, *metas[3:]]


def _batch_norm_no_stats_cpu(metas: list[Any], args: Any, kwargs: Any) -> list[Any]:
    """``_native_batch_norm_legit.no_stats`` (input, weight, bias, training, ...): the same rule, its
    ``training`` argument is the fourth."""
    training = args[3] if len(args) > 3 else kwargs.get("training")
    return _batch_norm_eval_cpu(metas, args[:3], kwargs, training=training)


def _multilabel_margin_cpu(metas: list[Any], args: Any, kwargs: Any) -> list[Any]:
    """``multilabel_margin_loss_forward`` of a 1-dim input with ``reduction='none'``: the CPU kernel returns a
    0-dim loss where torch's meta kernel answers [1] (found by the ModuleInfo gate, nn.MultiLabelMarginLoss)."""
    given = dict(zip(("self", "target", "reduction"), args, strict=False)) | kwargs
    if given["self"].dim() > 1 or given.get("reduction", 1) != 0:
        return metas
    return [(metas[0][0], (), (), 0), *metas[1:]]


def _norm_stats_cpu(params: tuple[str, ...], metas: list[Any], args: Any, kwargs: Any) -> list[Any]:
    """``native_layer_norm`` / ``native_group_norm`` on a CPU server: the CPU kernels keep the saved mean and
    rstd in a float16/bfloat16 input's dtype unless a weight or bias is float32 (``param_scalar_type``); the
    meta kernels answer float32, as CUDA's kernels do (found by the OpInfo gate once these ops ran whole on
    the server instead of their client-side decompositions)."""
    given = dict(zip(params, args, strict=False)) | kwargs
    x = given["input"]
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16):
        return metas
    mixed = any(isinstance(given.get(k), torch.Tensor) and given[k].dtype == torch.float32 for k in ("weight", "bias"))
    stat = torch.float32 if mixed else x.dtype
    return [metas[0], *((stat, *m[1:]) for m in metas[1:3]), *metas[3:]]


#: The argument names of _embedding_bag and _embedding_bag_forward_only (one schema).
_BAG_ARGS = tuple(a.name for a in _aten._embedding_bag.default._schema.arguments)


def _embedding_bag_cpu(metas: list[Any], args: Any, kwargs: Any, forward_only: bool = False) -> list[Any]:
    """``_embedding_bag(_forward_only)`` on a CPU server: torch's meta kernel answers for CUDA unless it sees a
    CPU tensor (``device_hint``); the CPU kernel returns ``offset2bag``, ``bag_size`` and ``max_indices`` in
    other shapes and in the offsets' dtype (the CPU branch of ``torch._meta_registrations.meta_embedding_bag``)."""
    given = dict(zip(_BAG_ARGS, args, strict=False)) | kwargs
    weight, indices, offsets = given["weight"], given["indices"], given["offsets"]
    mode, weights = given.get("mode", 0), given.get("per_sample_weights")
    padding_idx = given.get("padding_idx", -1)
    num_bags = offsets.size(0) - (1 if given.get("include_last_offset", False) else 0)
    # The CPU kernel's fast path takes bfloat16 too (the meta kernel's copy of the rule predates that).
    fast_sum = (weight.dtype in (torch.float32, torch.float16, torch.bfloat16) and weight.stride(1) == 1 and padding_idx < 0
                and (weights is None or weights.stride(0) == 1))
    dtype = offsets.dtype

    def contiguous(shape: tuple[int, ...]) -> tuple[Any, ...]:
        return (dtype, shape, tuple(torch.empty(shape, device="meta").stride()), 0)

    offset2bag = contiguous((indices.size(0),) if mode in (1, 2) or not fast_sum else (0,))
    # _embedding_bag_forward_only in sum mode keeps include_last_offset's extra bag (_embedding_bag does not)
    bags = (offsets.size(0),) if mode == 0 and forward_only else (num_bags,)
    max_indices = contiguous((num_bags, weight.size(1)) if mode == 2 else bags)
    return [metas[0], offset2bag, contiguous(bags), max_indices]


#: Where the real kernels' output layout depends on the server's device type (``RemoteDevice.kind``); the
#: meta cache keys these ops on that type too.
KIND_FIXUPS: dict[Any, dict[str, Any]] = {
    _aten.native_batch_norm.default: {"cpu": _batch_norm_eval_cpu},
    # graph branch: AOTAutograd's graphs (torch.compile) call the _legit forms; the same rule holds for them
    _aten._native_batch_norm_legit.default: {"cpu": _batch_norm_eval_cpu},
    _aten._native_batch_norm_legit.no_stats: {"cpu": _batch_norm_no_stats_cpu},
    _aten._native_batch_norm_legit_no_training.default: {
        "cpu": functools.partial(_batch_norm_eval_cpu, training=False)},
    _aten._batch_norm_with_update.default: {"cpu": functools.partial(_batch_norm_eval_cpu, training=True)},
    _aten._embedding_bag.default: {"cpu": _embedding_bag_cpu},
    _aten.native_layer_norm.default: {"cpu": functools.partial(
        _norm_stats_cpu, tuple(a.name for a in _aten.native_layer_norm.default._schema.arguments))},
    _aten.native_group_norm.default: {"cpu": functools.partial(
        _norm_stats_cpu, tuple(a.name for a in _aten.native_group_norm.default._schema.arguments))},
    _aten.multilabel_margin_loss_forward.default: {"cpu": _multilabel_margin_cpu},
    _aten._embedding_bag_forward_only.default: {"cpu": functools.partial(_embedding_bag_cpu, forward_only=True)},
}


def set_layout(t: torch.Tensor, shape: Any, stride: Any, offset: int) -> None:
    """Give ``t`` a new layout over its storage, growing the storage (here and on the server) if needed."""
    need = dmeta.storage_numel(shape, stride, offset) * t.element_size()
    storage = t.untyped_storage()
    if need > storage.nbytes():
        storage.resize_(need)  # genie._C's resize_storage, through the device's hook: see resize_hook
    _aten.set_.source_Storage_storage_offset(t, storage, offset, list(shape), list(stride))


def resize_hook(index: int, storage_id: int, nbytes: int) -> None:
    """genie._C's callback for a storage it is about to resize (``UntypedStorage.resize_``, ``Tensor.resize_``):
    queue ``CMD_RESIZE`` in the device's op stream, in order with its ops, and drop the storage's host shadow
    (a storage shrunk to 0 and grown back has its old size and new, zero-filled bytes). Raises, and nothing
    changes, on a lost device or inside a graph capture."""
    device = registry.device_at(index)
    device.connection.command([wm.CMD_RESIZE, device.local_index, storage_id, nbytes])
    if shadows.TABLE.entries:
        shadows.TABLE.drop(storage_id)


#: Ops with their own rules, filled in by genie.device.copies.
SPECIAL: dict[Any, Any] = {_aten._local_scalar_dense.default: _local_scalar}
