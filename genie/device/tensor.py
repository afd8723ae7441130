"""RemoteTensor: a wrapper tensor whose data lives on a genie node.

The wrapper carries only metadata (dtype, shape, strides, offset, conj/neg bits)
plus a :class:`TensorRef` naming the server-side handle. ``__torch_dispatch__``
turns every aten op into a fire-and-forget command whose outputs' metadata come
from :mod:`genie.device.meta`; sync points (``.cpu()``, ``.item()``, printing,
data-dependent shapes) block for one round trip.

C++ sees every remote tensor on ``remote_accelerator:0`` (the Python device
guard knows one device, and autograd's engine indexes its per-device queues by
that); the true index lives on the TensorRef and is what ``.device`` reports.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from genie.device import meta as dmeta
from genie.device.connection import NodeConnection
from genie.device.registry import RemoteDevice, table
from genie.errors import DeviceError
from genie.wire.values import device_ext, dtype_code, encode_common, handle_ext, inline_tensor

BACKEND = "remote_accelerator"
_CPP_DEVICE: torch.device | None = None  # set by registration, once the backend is renamed
_aten = torch.ops.aten


class TensorRef:
    """Owns one server-side handle; frees it when the last wrapper using it is gone.

    ``pending`` holds the encoded command of an ``empty*`` factory not sent yet: the
    server creates the tensor only when a command first names it, and a host-to-device
    copy into it becomes a plain upload under its handle (no server-side empty, no copy).
    """

    __slots__ = ("device", "handle", "pending", "__weakref__")

    def __init__(self, device: RemoteDevice, handle: int) -> None:
        self.device = device
        self.handle = handle
        self.pending: bytes | None = None

    @property
    def connection(self) -> NodeConnection:
        return self.device.connection

    def materialize(self) -> None:
        """Send the deferred factory command, if any (before any command that names the handle)."""
        cmd = self.pending
        if cmd is not None:
            self.pending = None
            self.device.connection.queue(cmd)

    def __del__(self) -> None:
        if self.pending is not None:
            return  # never created on the server
        try:
            self.device.connection.release(self.handle)
        except Exception:  # interpreter shutdown: the session dies with the process anyway
            pass


class RemoteTensor(torch.Tensor):
    """A tensor on ``remote_accelerator:N``. Made by factories and ``.to()``, never directly."""

    _genie: TensorRef

    @staticmethod
    def __new__(cls, ref: TensorRef | None, dtype: torch.dtype, shape: Any, stride: Any, offset: int) -> RemoteTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=_CPP_DEVICE or _cpp_device(),
            requires_grad=False
        )
        if ref is not None:
            r._genie = ref
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    # -- identity ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device(BACKEND, self._genie.device.index)

    def get_device(self) -> int:  # type: ignore[override]
        return self._genie.device.index

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return False

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # The C++ setter copies metadata only; the handle must follow the data.
        torch.Tensor.data.__set__(self, new)  # type: ignore[attr-defined]
        self.__dict__.pop("_sig", None)  # the cached signature described the old metadata
        ref = getattr(new, "_genie", None)
        if ref is not None:
            self._genie = ref

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        # C++ sees every remote tensor on index 0, so its "already there" shortcut would turn
        # remote_accelerator:1 -> :0 into a no-op; decide here with the true index instead.
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == BACKEND and (device.index or 0) != self._genie.device.index:
            return torch.ops.aten._to_copy.default(
                self, dtype=dtype or self.dtype, device=device, non_blocking=non_blocking,
                memory_format=memory_format or torch.preserve_format,
            )
        return super().to(*args, **kwargs)

    # -- sync points -------------------------------------------------------------------------
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        cpu = download(self)
        text = repr(cpu)
        extras = [f"device='{self.device}'"]
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        return text[:-1] + ", " + ", ".join(extras) + ")"

    def tolist(self) -> Any:  # type: ignore[override]
        return download(self).tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        if force:
            return self.cpu().numpy(force=True)
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if self.is_leaf:
            new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        if getattr(self, "_is_param", False):
            new._is_param = True  # type: ignore[attr-defined]
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild_remote, (download(self).detach(), self._genie.device.index, self.requires_grad))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        return execute(func, args, kwargs or {})


def _cpp_device() -> torch.device:
    global _CPP_DEVICE
    _CPP_DEVICE = torch.device(BACKEND, 0)
    return _CPP_DEVICE


def _rebuild_remote(cpu: torch.Tensor, index: int, requires_grad: bool) -> torch.Tensor:
    """Rebuild a saved remote tensor on its device (``torch.load``); needs ``genie.init()`` first."""
    out = cpu.to(torch.device(BACKEND, index))
    return out.requires_grad_(requires_grad) if requires_grad else out




# -- creation -----------------------------------------------------------------------------------
def make_wrapper(device: RemoteDevice, handle: int | None, m: dmeta.OutMeta, conj: bool = False,
                 neg: bool = False, ref: TensorRef | None = None) -> RemoteTensor:
    dtype, shape, stride, offset = m
    if ref is None and handle is not None:
        ref = TensorRef(device, handle)
    t = RemoteTensor(ref, dtype, shape, stride, offset)
    if conj:
        torch._C._set_conj(t, True)
    if neg:
        torch._C._set_neg(t, True)
    return t


def upload(cpu: torch.Tensor, device: RemoteDevice) -> RemoteTensor:
    """Copy a CPU tensor to ``device`` (contiguous there)."""
    conn = device.connection
    handle = conn.new_handle()
    conn.upload(handle, device.local_index, cpu)
    shape = tuple(cpu.shape)
    return make_wrapper(device, handle, (cpu.dtype, shape, _contiguous_strides(shape), 0))


def download(t: RemoteTensor) -> torch.Tensor:
    """Fetch a remote tensor's values into a new CPU tensor (a sync point)."""
    ref = t._genie
    ref.materialize()
    cpu = ref.connection.fetch(ref.handle, t.dtype, tuple(t.shape), device=ref.device.label)
    return cpu


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


# -- dispatch -----------------------------------------------------------------------------------
_meta_cache = dmeta.MetaCache()


def meta_cache() -> dmeta.MetaCache:
    return _meta_cache


def _is_remote_device(obj: Any) -> bool:
    return isinstance(obj, torch.device) and obj.type == BACKEND


def _signature(obj: Any) -> Any:
    if isinstance(obj, RemoteTensor):
        try:
            return obj.__dict__["_sig"]
        except KeyError:
            sig = ("R", obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.is_conj(), obj.is_neg())
            obj.__dict__["_sig"] = sig
            return sig
    if isinstance(obj, torch.Tensor):
        return ("C", obj.dtype, tuple(obj.shape), obj.is_conj(), obj.is_neg())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, torch.device):
        return ("D", obj.type)
    if isinstance(obj, float):
        return ("f", obj)
    return obj


@functools.cache
def _mutated_returns(func: Any) -> tuple[int | None, ...]:
    """For each return of ``func``, the flat argument position it aliases and writes, else None."""
    schema = func._schema
    positions: dict[Any, int] = {}
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            for s in a.alias_info.before_set:
                positions[s] = i
    result: list[int | None] = []
    for r in schema.returns:
        hit = None
        if r.alias_info is not None and r.alias_info.is_write:
            for s in r.alias_info.before_set:
                hit = positions.get(s)
        result.append(hit)
    return tuple(result)


def _arg_by_position(func: Any, pos: int, args: Any, kwargs: Any) -> Any:
    if pos < len(args):
        return args[pos]
    return kwargs.get(func._schema.arguments[pos].name)


def _leaves(args: Any, kwargs: Any) -> Any:
    """Every argument leaf (aten arguments nest only lists and tuples); cheaper than pytree."""
    stack = [*args, *kwargs.values()]
    while stack:
        a = stack.pop()
        if isinstance(a, (list, tuple)):
            stack.extend(a)
        else:
            yield a


def _find_device(func: Any, args: Any, kwargs: Any) -> RemoteDevice:
    """The one remote device this op runs on; mixed devices fail like CUDA's do."""
    found: RemoteDevice | None = None
    cpu_seen = False
    for a in _leaves(args, kwargs):
        d = None
        if isinstance(a, RemoteTensor):
            d = a._genie.device
        elif isinstance(a, torch.Tensor):
            if a.dim() > 0 and a.device.type != "meta":
                cpu_seen = True
            continue
        elif _is_remote_device(a):
            d = table().get(a.index)
        if d is not None:
            if found is not None and d.index != found.index:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"{found.label} and {d.label}! (when checking arguments for {func.name()})"
                )
            found = d
    if found is None:
        raise DeviceError(f"{func.name()} reached the remote device without a remote tensor or device argument")
    if cpu_seen:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{found.label} and cpu! (when checking arguments for {func.name()})"
        )
    return found


def _encoder(device: RemoteDevice) -> Any:
    """The msgpack ``default`` for one session (built once per connection)."""
    conn = device.connection
    cached = getattr(conn, "encoder", None)
    if cached is not None:
        return cached

    def default(obj: Any) -> Any:
        if isinstance(obj, RemoteTensor):
            ref = obj._genie
            if ref.pending is not None:
                ref.materialize()  # queued before the command being encoded
            if ref.connection is not conn:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"{device.label} and {ref.device.label}!"
                )
            return handle_ext(ref.handle)
        if isinstance(obj, torch.Tensor):
            return inline_tensor(obj)
        if isinstance(obj, torch.device):
            if obj.type != BACKEND:
                raise DeviceError(f"a {obj} device argument cannot be sent to {device.label}")
            return device_ext(table().get(obj.index).local_index)
        encoded = encode_common(obj)
        if encoded is NotImplemented:
            raise DeviceError(f"genie cannot send a {type(obj).__name__} argument to the server")
        return encoded

    conn.encoder = default
    return default


def _to_meta_arg(obj: Any) -> Any:
    if isinstance(obj, RemoteTensor):
        m = dmeta.to_meta(obj)
        return m._neg_view() if obj.is_neg() else m
    if _is_remote_device(obj):
        return torch.device("meta")
    return obj


def execute(func: Any, args: Any, kwargs: Any) -> Any:
    """Run one aten op on the remote device its arguments live on."""
    special = _SPECIAL.get(func)
    if special is not None:
        return special(func, args, kwargs)
    return _general(func, args, kwargs)


def _general(func: Any, args: Any, kwargs: Any, device: RemoteDevice | None = None) -> Any:
    """The common path: meta inference (cached), then a fire-and-forget command."""
    if device is None:
        device = _find_device(func, args, kwargs)
    try:
        key = (func, _signature(args), _signature(kwargs))
        hash(key)
    except TypeError:
        key = None
    if func in _SERVER_OPS:
        return _call_on_server(func, args, kwargs, device)
    cached = _meta_cache.lookup(key) if key is not None else None
    if cached is None:
        try:
            metas, spec, flat_meta = dmeta.run_meta(func, args, kwargs, _to_meta_arg)
        except dmeta.NeedsServer:
            return _call_on_server(func, args, kwargs, device)
        bits = [(o.is_conj(), o.is_neg()) if isinstance(o, torch.Tensor) else (False, False) for o in flat_meta]
        values = [None if isinstance(o, torch.Tensor) else o for o in flat_meta]
        cached = (metas, spec, bits, values)
        if key is not None:
            _meta_cache.store(key, cached)
    metas, spec, bits, flat_values = cached
    mask = _output_mask(func, args, kwargs)
    if mask is not None:  # backward ops skip masked-off outputs (undefined tensors), meta does not
        metas = [m if i >= len(mask) or mask[i] else None for i, m in enumerate(metas)]
    mutated = _mutated_returns(func)
    conn = device.connection
    outs: list[Any] = []
    wire_outs: list[Any] = []
    for i, m in enumerate(metas):
        if m is None:  # a number the meta run computed as the real kernel would
            outs.append(flat_values[i])
            continue
        position = mutated[i] if i < len(mutated) else None
        target = _arg_by_position(func, position, args, kwargs) if position is not None else None
        if isinstance(target, RemoteTensor):
            if (tuple(target.shape), target.stride(), target.storage_offset()) != (m[1], m[2], m[3]):
                target.data = make_wrapper(device, None, m, *bits[i])  # metadata only; keeps its handle
            outs.append(target)
            handle = target._genie.handle
        else:
            handle = conn.new_handle()
            outs.append(make_wrapper(device, handle, m, *bits[i]))
        wire_outs.append([handle, dtype_code(m[0]), list(m[1]), list(m[2]), m[3]])
    if func in _DEFERRABLE and len(outs) == 1:
        outs[0]._genie.pending = conn.op(func.name(), args, kwargs, wire_outs, _encoder(device), defer=True)
        return outs[0]
    conn.op(func.name(), args, kwargs, wire_outs, _encoder(device))
    if len(outs) == 1 and spec.is_leaf():
        return outs[0]
    return tree_unflatten(outs, spec)


@functools.cache
def _output_mask_position(func: Any) -> int | None:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "output_mask":
            return i
    return None


def _output_mask(func: Any, args: Any, kwargs: Any) -> list[bool] | None:
    pos = _output_mask_position(func)
    return None if pos is None else list(_arg_by_position(func, pos, args, kwargs))


def _call_on_server(func: Any, args: Any, kwargs: Any, device: RemoteDevice) -> Any:
    """Run an op synchronously: data-dependent shapes and number results."""
    conn = device.connection
    returns = func._schema.returns
    count = 64 if any("[]" in str(r.type) for r in returns) else len(returns)
    first = conn.new_handle()
    handles = [first] + [conn.new_handle() for _ in range(count - 1)]
    result = conn.call(func.name(), args, kwargs, handles, _encoder(device), device=device.label)
    return _decode_call_result(func, result, device)


def _decode_call_result(func: Any, result: Any, device: RemoteDevice) -> Any:
    returns = func._schema.returns
    values = result if len(returns) != 1 else [result]

    def tensor(desc: Any) -> RemoteTensor:
        handle, code, shape, stride, offset = desc
        from genie.wire.values import dtype_from_code

        return make_wrapper(device, handle, (dtype_from_code(code), tuple(shape), tuple(stride), offset))

    out: list[Any] = []
    for r, v in zip(returns, values, strict=False):
        kind = str(r.type)
        if kind.startswith("Tensor[]") or kind.startswith("List[Tensor]"):
            out.append([tensor(d) for d in v])
        elif kind.startswith("Tensor"):
            out.append(tensor(v) if v is not None else None)
        else:
            out.append(v)
    return out[0] if len(returns) == 1 else tuple(out)


# -- ops with their own rules ---------------------------------------------------------------------
def _alias_same_handle(func: Any, args: Any, kwargs: Any) -> Any:
    """detach/alias: same data, same metadata: share the handle, no server round."""
    src = args[0]
    out = make_wrapper(src._genie.device, None, (src.dtype, tuple(src.shape), src.stride(), src.storage_offset()),
                       src.is_conj(), src.is_neg(), ref=src._genie)
    return out


def _to_copy(func: Any, args: Any, kwargs: Any) -> Any:
    src = args[0]
    target = kwargs.get("device")
    if isinstance(src, RemoteTensor) and target is not None and target.type == "cpu":
        cpu = download(src)
        rest = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format") and v is not None}
        out = cpu.to(**rest) if rest else cpu
        if kwargs.get("pin_memory"):
            out = out.pin_memory()
        return out
    if isinstance(src, RemoteTensor) and target is not None and _is_remote_device(target):
        dest = table().get(target.index)
        if dest.connection is not src._genie.connection:  # another node: through this client
            cpu = download(src)
            rest = {k: v for k, v in kwargs.items() if k == "dtype" and v is not None}
            return upload(cpu.to(**rest) if rest else cpu, dest)
        return _general(func, args, kwargs, device=dest)  # same node, maybe another of its devices
    return _general(func, args, kwargs)


def _copy_into(dst: Any, src: Any, non_blocking: bool = False) -> Any:
    if isinstance(dst, RemoteTensor) and isinstance(src, RemoteTensor):
        if dst._genie.connection is not src._genie.connection:
            src = upload(download(src), dst._genie.device)
        return _general(_aten.copy_.default, (dst, src, non_blocking), {})
    if isinstance(dst, RemoteTensor):  # host -> device
        ref = dst._genie
        if (ref.pending is not None and tuple(src.shape) == tuple(dst.shape) and not dst.is_conj()
                and not dst.is_neg() and dst.storage_offset() == 0
                and dst.stride() == _contiguous_strides(tuple(dst.shape))):
            # A fresh tensor about to be overwritten whole (``.to(device)``): upload into its handle.
            ref.pending = None
            ref.connection.upload(ref.handle, ref.device.local_index, src.detach().to("cpu", dst.dtype))
            return dst
        if src.dim() == 0 and src.device.type == "cpu":
            return _general(_aten.copy_.default, (dst, src, non_blocking), {})
        tmp = upload(src.detach().to("cpu"), dst._genie.device)
        return _general(_aten.copy_.default, (dst, tmp, non_blocking), {})
    # device -> host
    dst.copy_(download(src))
    return dst


def _copy_(func: Any, args: Any, kwargs: Any) -> Any:
    return _copy_into(args[0], args[1], bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False))


def _copy_from(func: Any, args: Any, kwargs: Any) -> Any:
    src, dst = args[0], args[1]
    return _copy_into(dst, src)


def _shallow_copy_type(func: Any, args: Any, kwargs: Any) -> bool:
    return all(isinstance(a, RemoteTensor) for a in args[:2])


def _false(func: Any, args: Any, kwargs: Any) -> bool:
    return False


#: Factories of uninitialised memory: sent only when something first uses their result.
_DEFERRABLE = frozenset({_aten.empty.memory_format, _aten.empty_strided.default})

#: Ops whose result is a number or a data-dependent shape: always a round trip.
_SERVER_OPS = frozenset({
    _aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default,
    _aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default, _aten.unique_consecutive.default,
    _aten.unique_dim.default,
})

_SPECIAL: dict[Any, Any] = {
    _aten.detach.default: _alias_same_handle,
    _aten.alias.default: _alias_same_handle,
    _aten._to_copy.default: _to_copy,
    _aten.copy_.default: _copy_,
    _aten._copy_from.default: _copy_from,
    _aten._has_compatible_shallow_copy_type.default: _shallow_copy_type,
    _aten.is_pinned.default: _false,
}
