"""Arguments CUDA takes that the plain op path would refuse or send wrong, and layouts it never sends.

- **Numbers where a Tensor goes.** ATen's composites wrap a Python number in a CPU tensor
  (``remainder(x, 5)`` calls ``remainder.Tensor`` with a *wrapped number*); the fallback gets the number
  back, and torch refuses a number for a ``Tensor`` argument of most ops (all but
  ``torch._C._should_allow_numbers_as_tensors``). Such a call runs as the op's ``Scalar`` overload
  (``remainder.Scalar``), whose kernels wrap the number as the composite did; where there is none, the
  number travels as a 0-dim CPU tensor.
- **CPU indices.** ``x[cpu_mask]``, ``x[cpu_idx] = v`` and ``index_put_`` with CPU indices work on CUDA,
  which moves the indices to the device in the kernel; here they are uploaded before the op is sent.
- **CPU scalars.** A 0-dim CPU tensor mixed with device tensors is a scalar on CUDA; meta kernels that
  take the first argument's device for the output (``torch.tensor(2.0) * x``) get it as a meta tensor.
- **Data-dependent sizes CUDA reads back.** ``repeat_interleave(repeats)`` without ``output_size`` sums
  ``repeats`` first (one sync, as CUDA's kernel does) and sends the size with the call.
- **Sparse and quantized layouts** are not supported: they fail here, before anything is sent, with a
  :class:`~genie.errors.DeviceError` naming the layout, instead of a refusal from the server's allow-list
  or torch's "Could not run ... with arguments from the 'Sparseremote_accelerator' backend".
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from genie.errors import DeviceError

_aten = torch.ops.aten
_NUMBERS = frozenset({int, float, bool, complex})

#: Ops whose ``indices`` (argument 1) CUDA accepts on the CPU (ATen's index kernels move them to the device).
INDEX_OPS = frozenset({
    "aten::index.Tensor", "aten::index.Tensor_out", "aten::_index_put_impl_", "aten::_index_put_impl",
    "aten::_index_put_impl.out", "aten::index_put_", "aten::index_put", "aten::index_put.out",
    "aten::_unsafe_index.Tensor", "aten::_unsafe_index_put",
})

#: Name prefixes of ops that make or take sparse or quantized tensors: (prefix, the layout named in the error).
_UNSUPPORTED_PREFIXES = (
    ("aten::_to_sparse_csr", "sparse CSR (torch.sparse_csr)"),
    ("aten::_to_sparse_csc", "sparse CSC (torch.sparse_csc)"),
    ("aten::_to_sparse_bsr", "sparse BSR (torch.sparse_bsr)"),
    ("aten::_to_sparse_bsc", "sparse BSC (torch.sparse_bsc)"),
    ("aten::to_sparse_csr", "sparse CSR (torch.sparse_csr)"),
    ("aten::to_sparse_csc", "sparse CSC (torch.sparse_csc)"),
    ("aten::to_sparse_bsr", "sparse BSR (torch.sparse_bsr)"),
    ("aten::to_sparse_bsc", "sparse BSC (torch.sparse_bsc)"),
    ("aten::_to_sparse", "sparse COO (torch.sparse_coo)"),
    ("aten::to_sparse", "sparse COO (torch.sparse_coo)"),
    ("aten::sparse_", "sparse"),
    ("aten::_sparse_", "sparse"),
    ("aten::_validate_sparse", "sparse"),
    ("aten::quantize_per", "quantized"),
    ("aten::_make_per_tensor_quantized", "quantized"),
    ("aten::_make_per_channel_quantized", "quantized"),
    ("aten::quantized_", "quantized"),
)
#: ... but these answer for dense tensors too.
_DENSE_ANSWERS = frozenset({"aten::sparse_dim", "aten::_sparse_dim"})

_LAYOUT_NAMES = {torch.sparse_coo: "sparse COO (torch.sparse_coo)", torch.sparse_csr: "sparse CSR (torch.sparse_csr)",
                 torch.sparse_csc: "sparse CSC (torch.sparse_csc)", torch.sparse_bsr: "sparse BSR (torch.sparse_bsr)",
                 torch.sparse_bsc: "sparse BSC (torch.sparse_bsc)", torch._mkldnn: "mkldnn"}  # type: ignore[attr-defined]

_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})

#: The dispatch keys a sparse or quantized tensor (or factory) of the device dispatches to.
UNSUPPORTED_KEYS = {"SparsePrivateUse1": "sparse", "SparseCsrPrivateUse1": "sparse compressed (CSR/CSC/BSR/BSC)",
                    "QuantizedPrivateUse1": "quantized"}


def unsupported_layout_error(layout: str, op: str) -> DeviceError:
    """The error of an op that would make or use a ``layout`` tensor on the device."""
    return DeviceError(
        f"{op}: {layout} tensors are not supported on remote_accelerator (only strided, dense tensors are); "
        "keep this tensor on the CPU, or use a dense equivalent (.to_dense(), .dequantize()) before moving it")


def special_for(name: str, schema: Any, run_op: Any) -> Any:
    """The rule for op ``name`` (an ``OpInfo.special``), or None: it runs as every other op.

    ``run_op(func, args, kwargs, teach=True)`` is genie.device.dispatch's, which calls this: a rule rewrites
    the call and hands it back there (passed in, so this module never imports its caller)."""
    if name not in _DENSE_ANSWERS:
        for prefix, layout in _UNSUPPORTED_PREFIXES:
            if name.startswith(prefix):
                return functools.partial(_refuse, layout)
    if name in INDEX_OPS:
        return functools.partial(_device_indices, run_op)
    if name == "aten::repeat_interleave.Tensor":
        return functools.partial(_repeat_interleave_size, run_op)
    if not torch._C._should_allow_numbers_as_tensors(name.split("::", 1)[1].split(".", 1)[0]):
        slots = tuple(i for i, a in enumerate(schema.arguments)
                      if i > 0 and str(a.type) == "Tensor" and a.alias_info is None and not a.kwarg_only)
        if slots:
            return functools.partial(_numbers_in_tensor_slots, run_op, slots)
    return None


def check_layouts(name: str, args: Any, kwargs: Any) -> None:
    """Refuse a ``layout=`` other than strided and a quantized ``dtype=`` argument (checked once per signature)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.layout) and value != torch.strided:
            raise unsupported_layout_error(_LAYOUT_NAMES.get(value, str(value)), name)
        if isinstance(value, torch.dtype) and value in _QUANTIZED:
            raise unsupported_layout_error(f"quantized ({value})", name)


def _refuse(layout: str, func: Any, args: Any, kwargs: Any) -> Any:
    raise unsupported_layout_error(layout, func.name())


def refuse_dispatch_key(key: str) -> Any:
    """A boxed fallback for ``key`` (SparsePrivateUse1...): every op there fails with the layout's error."""

    def fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
        raise unsupported_layout_error(UNSUPPORTED_KEYS[key], op.name())

    return fallback


# -- CPU indices ------------------------------------------------------------------------------------
def _device_indices(run_op: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """``index``/``index_put_`` with CPU index tensors: uploaded to ``self``'s device first, as CUDA's kernels do."""
    base = args[0] if args else kwargs.get("self")
    in_args = len(args) > 1
    indices = args[1] if in_args else kwargs.get("indices")
    if (isinstance(base, torch.Tensor) and base.get_device() >= 0 and isinstance(indices, (list, tuple))
            and any(_on_host(i) for i in indices)):
        moved = [i.to(base.device) if _on_host(i) else i for i in indices]
        if in_args:
            args = (args[0], moved, *args[2:])
        else:
            kwargs = {**kwargs, "indices": moved}
        return run_op(func, args, kwargs, teach=False)  # genie._C would send the CPU indices
    return run_op(func, args, kwargs)


def _on_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.get_device() < 0 and not t.is_meta


# -- data-dependent sizes ---------------------------------------------------------------------------
def _repeat_interleave_size(run_op: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """``repeat_interleave(repeats)`` without ``output_size``: the output is as long as ``repeats`` sums to,
    which only the data says. CUDA's kernel reads that sum back to the host (a sync); so does this rule,
    then sends the call with ``output_size``, whose output the client's meta kernel and the server's
    pre-flight can size (the server refuses the call without it, and checks the sum)."""
    given = dict(zip(("repeats", "output_size"), args, strict=False)) | kwargs
    repeats = given.get("repeats")
    if given.get("output_size") is None and isinstance(repeats, torch.Tensor) and repeats.dim() == 1:
        size = int(repeats.sum().item()) if repeats.numel() else 0
        return run_op(func, (repeats,), {"output_size": size}, teach=False)
    return run_op(func, args, kwargs)


# -- numbers where a Tensor goes --------------------------------------------------------------------
def _numbers_in_tensor_slots(run_op: Any, slots: tuple[int, ...], func: Any, args: Any, kwargs: Any) -> Any:
    count = len(args)
    for i in slots:  # most calls have none: the common path at once
        if i < count and type(args[i]) in _NUMBERS:
            break
    else:
        return run_op(func, args, kwargs)
    numbers = tuple(i for i in slots if i < count and type(args[i]) in _NUMBERS)
    scalar_op = scalar_overload(func, numbers)
    if scalar_op is not None:
        return run_op(scalar_op, args, kwargs)
    # No Scalar overload: a 0-dim CPU tensor (crosses the wire inline, as a CPU scalar does on CUDA). Not
    # taught to genie._C: it would send the call it sees, with the number.
    wrapped = list(args)
    for i in numbers:
        wrapped[i] = torch.tensor(args[i])
    return run_op(func, tuple(wrapped), kwargs, teach=False)


@functools.cache
def scalar_overload(func: Any, positions: tuple[int, ...]) -> Any:
    """The overload of ``func``'s operator that takes a Scalar at ``positions`` and is otherwise the same
    (``remainder.Tensor_out`` -> ``remainder.Scalar_out``), or None. Looked up in the dispatcher's own
    overload list, never by a name from the network."""
    schema = func._schema
    packet = func.overloadpacket
    for overload_name in packet.overloads():
        candidate = getattr(packet, overload_name)
        other = candidate._schema
        if candidate is func or len(other.arguments) != len(schema.arguments) or \
                [str(r.type) for r in other.returns] != [str(r.type) for r in schema.returns]:
            continue
        if all(a.name == b.name and a.kwarg_only == b.kwarg_only
               and str(b.type) == ("number" if i in positions else str(a.type))  # a Scalar's type prints so
               for i, (a, b) in enumerate(zip(schema.arguments, other.arguments, strict=True))):
            return candidate
    return None


# -- CPU scalars in meta runs -----------------------------------------------------------------------
def has_cpu_scalar(args: Any, kwargs: Any) -> bool:
    """Whether a 0-dim CPU tensor is among the (top-level or listed) arguments."""
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for v in items:
            if isinstance(v, torch.Tensor) and v.get_device() < 0 and not v.is_meta and v.dim() == 0:
                return True
    return False


def meta_with_scalars(obj: Any, remote_to_meta: Any) -> Any:
    """``remote_to_meta`` for a meta run that also takes 0-dim CPU tensors as 0-dim meta tensors (same dtype,
    same type-promotion rank: a CPU scalar and a meta scalar promote alike)."""
    if isinstance(obj, torch.Tensor) and obj.get_device() < 0 and not obj.is_meta and obj.dim() == 0:
        return torch.empty((), dtype=obj.dtype, device="meta")
    return remote_to_meta(obj)
