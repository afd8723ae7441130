"""Pre-flight: before an op runs, work out on meta tensors what it will allocate, and refuse what is too big.

The client computes every op's outputs on meta tensors for its own bookkeeping,
but a server must not trust that. So before the real kernel runs, the server
runs the op once more on meta tensors built from the *resolved* arguments
(shapes, strides and dtypes only; no data) and refuses, naming the op, the
size and the limit:

- any input that iterates over more than ``max_op_elements`` elements (a
  stride-0 ``expand`` of one element to 2**40 makes a tiny tensor whose
  reduction runs for twenty minutes) - :class:`~genie.errors.ForbiddenOpError`;
- any output of more than ``max_op_elements`` elements - ForbiddenOpError;
- new memory (fresh outputs plus in-place growth such as ``resize_`` or an
  ``out=`` tensor being resized) beyond the session's remaining byte budget
  (``max_session_bytes`` minus what it holds) -
  :class:`~genie.errors.QuotaExceededError`. So ``ones([2**28])`` under a
  64 MiB quota is refused before a byte is allocated.

A meta kernel that raises (mismatched shapes, a dim out of range, malformed
lists) refuses the op too: the real CPU/CUDA kernel is never reached with
arguments its own checks may miss. Ops whose meta kernel is missing or whose
output size depends on data (``nonzero``) are left to the real kernel and the
quota checks after it: their outputs are bounded by their inputs (one with no
tensor input that cannot be planned is refused); the allowed ops without a meta
kernel whose outputs are not (the histograms: bins are numbers) have output
rules in :mod:`genie.server.sizerules`. Before the plan: dtype,
layout and memory-format arguments must be those types (the JIT schema takes
ints, and torch trusts any int), layouts strided, ``pin_memory`` false; after
the size checks, the op's validator runs if it has one
(:mod:`genie.server.validators`).

The result of a meta run depends only on the op and the arguments' shapes,
strides, dtypes and plain values, so it is cached by that signature; a repeated
op costs one signature walk and one dict lookup.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import torch

from genie import lazy_dynamo
from genie.errors import ForbiddenOpError, QuotaExceededError, RemoteExecutionError
from genie.server import sizerules, validators

log = logging.getLogger("genie.server.preflight")

#: Default cap on the elements one op may iterate over or produce (``max_op_elements``).
DEFAULT_MAX_OP_ELEMENTS = (1 << 31) - 1
#: Most cached signatures; the cache is emptied when full (cheap, and hostile clients cannot grow it).
CACHE_SIZE = 8192
_META = torch.device("meta")


@attrs.frozen
class Plan:
    """What a meta run found: new bytes the op allocates, its largest output, or the meta kernel's refusal."""

    new_bytes: int = 0
    max_elements: int = 0
    #: The largest input's element count and shape (a stride-0 view counts in full).
    max_input: int = 0
    input_shape: tuple[int, ...] = ()
    #: Whether the op has a tensor input at all (an empty one bounds a data-dependent output too: nonzero of [5, 0]).
    has_inputs: bool = False
    error: str | None = None
    #: False when the op could not be planned (no meta kernel, data-dependent output): nothing is refused.
    planned: bool = True


#: Meta kernels raise these for what meta tensors cannot do at all (read data): not the arguments' fault.
_META_LIMITS = ("meta tensor", "meta device", "on meta", "'meta'", "data-dependent", "data dependent")


_cache: dict[Any, Plan] = {}
#: Ops whose meta run raised NotImplementedError (no meta kernel): never tried again.
_no_meta: set[torch._ops.OpOverload] = set()


class _Unhashable(Exception):
    """An argument the signature cannot key (internal: the op is planned without the cache)."""


# Markers no decoded wire value can equal, so a list of numbers never keys like a tensor (the cache is shared
# by every session of the process: a colliding key would let one session's plan answer for another's op).
_TENSOR, _NAN, _GENERATOR = object(), object(), object()
_PLAIN = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})


def _sig(values: Any) -> tuple[Any, ...]:
    """A hashable key of argument values: tensors by shape, strides and dtype, plain values as they are.

    The hot path of every op: one type lookup per value, no recursion for flat argument lists. Keys carry
    types (``_TENSOR``, ``float``) so that values which compare equal across types never share a plan.
    """
    out: list[Any] = []
    append = out.append
    for value in values:
        kind = type(value)
        if kind is torch.Tensor:
            append((_TENSOR, value.shape, value.stride(), value.dtype))
        elif kind is int:
            append(value)
        elif kind in _PLAIN:
            # (type, value): 1, 1.0 and True hash alike but make different ops; NaN never equals itself
            append((kind, value if kind is not float or value == value else _NAN))
        elif kind is list or kind is tuple:
            append(_sig(value))
        elif isinstance(value, torch.Generator):
            append(_GENERATOR)
        elif isinstance(value, torch.Tensor):  # a subclass: same key as a tensor
            append((_TENSOR, value.shape, value.stride(), value.dtype))
        else:
            raise _Unhashable
    return tuple(out)


def _to_meta(value: Any, inputs: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise NotImplementedError("pre-flight covers strided, unquantized tensors")
        meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=_META)
        inputs.append(meta)
        return meta
    if isinstance(value, list):
        return [_to_meta(v, inputs) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_meta(v, inputs) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v, inputs) for k, v in value.items()}
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, torch.Generator):
        return None  # meta kernels draw nothing; a CPU generator would be refused for a meta tensor
    return value


_device_kwarg: dict[torch._ops.OpOverload, bool] = {}


def _takes_device(op: torch._ops.OpOverload) -> bool:
    """Whether the op has a keyword-only ``device`` argument (the factories)."""
    found = _device_kwarg.get(op)
    if found is None:
        found = _device_kwarg[op] = any(a.name == "device" and a.kwarg_only for a in op._schema.arguments)
    return found


#: Most tensors one op may return in a list (split, unbind, chunk, tensor_split ...).
MAX_LIST_OUTPUTS = 1 << 16
_COUNTED = ("split", "unbind", "chunk")


def _list_outputs(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> int:
    """How many tensors a split-like op will return (before any run: the meta run would make them all)."""
    named = dict(zip((a.name for a in op._schema.arguments), args, strict=False)) | kwargs  # fewer args: defaults
    x = named.get("self")
    count = 0
    for key in ("sections", "chunks"):
        if isinstance(named.get(key), int):
            count = max(count, named[key])
    dim = named.get("dim", 0)
    if isinstance(x, torch.Tensor) and isinstance(dim, int) and -x.dim() <= dim < max(x.dim(), 1) and x.dim():
        size = x.size(dim)
        if "unbind" in op.name():
            count = max(count, size)
        split = named.get("split_size")
        if isinstance(split, int) and split > 0:
            count = max(count, -(-size // split))
    for key in ("split_sizes", "indices", "tensor_indices_or_sections"):
        if isinstance(named.get(key), list):
            count = max(count, len(named[key]))
    return count


def _leaves(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _leaves(item, out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def plan(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> Plan:
    """Run ``op`` on meta copies of its arguments (``planned`` is False when that cannot be done)."""
    leaves = _leaves(args, []) + _leaves(list(kwargs.values()), [])
    biggest = max(leaves, key=lambda t: t.numel(), default=None)
    max_input, input_shape = (biggest.numel(), tuple(biggest.shape)) if biggest is not None else (0, ())
    unplanned = Plan(planned=False, max_input=max_input, input_shape=input_shape, has_inputs=biggest is not None)
    if op in _no_meta:
        return unplanned
    lazy_dynamo.defer()  # torch's Python meta kernels would import dynamo on their first call (genie.lazy_dynamo)
    inputs: list[torch.Tensor] = []
    try:
        meta_args = _to_meta(args, inputs)
        meta_kwargs = _to_meta(kwargs, inputs)
        if _takes_device(op):
            meta_kwargs["device"] = _META  # device=None means the CPU: a factory must not allocate for real here
        before = {id(t): _nbytes(t) for t in inputs}
        storages = {t.untyped_storage()._cdata for t in inputs}
        rule = sizerules.RULES.get(op)
        result = op(*meta_args, **meta_kwargs) if rule is None else sizerules.run(op, meta_args, meta_kwargs)
    except NotImplementedError as exc:
        if "pre-flight covers" not in str(exc):
            _no_meta.add(op)
        return unplanned
    except Exception as exc:  # noqa: BLE001 - meta registrations raise AssertionError, RuntimeError, ValueError ...
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if any(limit in text for limit in _META_LIMITS):
            return unplanned  # item(), nonzero(), unique() ...: their outputs are bounded by their inputs
        return Plan(error=text[:500], max_input=max_input, input_shape=input_shape)
    new_bytes = max_elements = 0
    seen: set[int] = set()
    for t in _leaves(result, []):
        if not isinstance(t, torch.Tensor) or t.device != _META:
            continue
        max_elements = max(max_elements, t.numel())
        if t.layout != torch.strided:  # no storage to look at: count its elements
            new_bytes += t.numel() * t.element_size()
            continue
        key = t.untyped_storage()._cdata
        if key in seen:
            continue
        seen.add(key)
        if key in storages:  # an input (in place, out=, a view): only what it grew by is new
            grown = _nbytes(t) - before.get(id(t), _nbytes(t))
            new_bytes += max(0, grown)
        else:
            new_bytes += _nbytes(t)
    # In-place growth of an input the op does not return (resize_ on an out= argument returned elsewhere).
    for t in inputs:
        if t.untyped_storage()._cdata not in seen:
            new_bytes += max(0, _nbytes(t) - before[id(t)])
    return Plan(new_bytes=new_bytes, max_elements=max_elements, max_input=max_input, input_shape=input_shape)


def signature(values: Any) -> tuple[Any, ...] | None:
    """The key :func:`cached_plan` uses for these values (tensors by shape, strides and dtype; plain values as
    they are), or None when one cannot be keyed: what the pre-flight's answers depend on, for callers that
    cache them over several ops (a replayed graph's inputs, :mod:`genie.server.graphs`)."""
    try:
        return _sig(values)
    except _Unhashable:
        return None


def cached_plan(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> Plan:
    """:func:`plan`, cached by the op and the arguments' signature."""
    try:
        key = (op, _sig(args), _sig(kwargs.items()) if kwargs else ())
    except _Unhashable:
        return plan(op, args, kwargs)
    found = _cache.get(key)
    if found is None:
        if len(_cache) >= CACHE_SIZE:
            _cache.clear()
        _cache[key] = found = plan(op, args, kwargs)
    return found


_ENUMS = {"ScalarType": torch.dtype, "Layout": torch.layout, "MemoryFormat": torch.memory_format}
_enum_args: dict[torch._ops.OpOverload, tuple[tuple[int, str, type], ...]] = {}


def _enum_spec(op: torch._ops.OpOverload) -> tuple[tuple[int, str, type], ...]:
    """(position, name, python type) of the op's dtype/layout/memory-format arguments (ints in the JIT schema)
    and its ``pin_memory`` flag."""
    spec = _enum_args.get(op)
    if spec is None:
        found = []
        for position, argument in enumerate(op._schema.arguments):
            real = str(argument.real_type).removeprefix("Optional[").removesuffix("]")
            if real in _ENUMS:
                found.append((-1 if argument.kwarg_only else position, argument.name, _ENUMS[real]))
            elif argument.name == "pin_memory":
                found.append((-1 if argument.kwarg_only else position, argument.name, bool))
        _enum_args[op] = spec = tuple(found)
    return spec


def _check_enums(op: torch._ops.OpOverload, label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """A dtype, layout or memory format must arrive as one (the schema takes ints: torch would trust any int)."""
    for position, name, kind in _enum_spec(op):
        value = kwargs.get(name) if position < 0 or position >= len(args) else args[position]
        if value is not None and not isinstance(value, kind):
            raise RemoteExecutionError(f"{label}: argument {name!r} must be a {kind.__name__} or None, got "
                                       f"{type(value).__name__} {str(value)[:40]}")
        if kind is bool and value:
            raise ForbiddenOpError(f"{label}: pin_memory=True is not served (page-locked memory is outside the "
                                   "session's byte quota)")
        if kind is torch.layout and value is not None and value != torch.strided:
            raise ForbiddenOpError(f"{label}: layout {value} is not served (genie tensors are strided)")


_Extras = tuple[bool, validators.Check | None, bool, validators.Check | None]
_extras: dict[torch._ops.OpOverload, _Extras] = {}


def _extras_of(op: torch._ops.OpOverload) -> _Extras:
    """(whether the op takes dtype/layout/memory-format arguments, its validator, whether it is split-like, its
    pre-check), cached per op."""
    counted = any(word in op.name() for word in _COUNTED)
    _extras[op] = found = (bool(_enum_spec(op)), validators.check_for(op), counted, validators.pre_check_for(op))
    return found


def _too_many(label: str, what: str, count: int, limit: int) -> ForbiddenOpError:
    return ForbiddenOpError(
        f"{label} refused before running: {what} has {count} elements (2**{math.log2(count):.1f}), more than "
        f"this server's limit of {limit} elements per op (max_op_elements); split the work into smaller ops")


def over_quota(label: str, new_bytes: int, remaining_bytes: int) -> QuotaExceededError:
    """The refusal of an op that would allocate ``new_bytes`` with ``remaining_bytes`` left of the session's quota."""
    return QuotaExceededError(
        f"{label} refused before running: it would allocate {new_bytes} bytes, more than the "
        f"{remaining_bytes} bytes left of this session's limit (max_session_bytes)")


def _check_arguments(op: torch._ops.OpOverload, extras: _Extras, label: str, args: list[Any],
                     kwargs: dict[str, Any]) -> None:
    if extras[0]:
        _check_enums(op, label, args, kwargs)
    if extras[2]:
        count = _list_outputs(op, args, kwargs)
        if count > MAX_LIST_OUTPUTS:
            raise ForbiddenOpError(f"{label} refused before running: it would return {count} tensors, more than "
                                   f"{MAX_LIST_OUTPUTS}")


def check_arguments(op: torch._ops.OpOverload, label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """The refusals of :func:`check` that need no tensor: dtype, layout and memory-format arguments of their own
    types, strided layouts, ``pin_memory`` false, split-like ops returning at most :data:`MAX_LIST_OUTPUTS`
    tensors (as far as the plain values say). A graph definition's nodes pass them before it is kept; what
    depends on the tensors is checked at replay, by :func:`check`."""
    _check_arguments(op, _extras.get(op) or _extras_of(op), label, args, kwargs)


def check(op: torch._ops.OpOverload, label: str, args: list[Any], kwargs: dict[str, Any], *,
          max_elements: int, remaining_bytes: int | None) -> Plan:
    """Refuse ``op`` on these resolved arguments before it runs (see the module docstring); returns the meta
    run's :class:`Plan` it passed (what a command plan of :mod:`genie.server.plans` keeps: its ``new_bytes``).

    ``remaining_bytes`` is the session's unused byte budget (None: unbounded);
    ``max_elements`` the per-op element cap (0: unbounded).
    """
    extras = _extras.get(op) or _extras_of(op)
    _check_arguments(op, extras, label, args, kwargs)
    if extras[3] is not None:
        extras[3](label, args, kwargs)
    found = cached_plan(op, args, kwargs)
    if max_elements and found.max_input > max_elements:
        raise _too_many(label, f"an input of shape {list(found.input_shape)}", found.max_input, max_elements)
    if extras[1] is not None:  # after the size check: some validators read the data
        extras[1](label, args, kwargs)
    if not found.planned and not found.has_inputs:
        # Nothing bounds what an op without tensor inputs makes if its meta run failed: refuse it.
        raise ForbiddenOpError(f"{label} refused before running: its output size cannot be worked out in "
                               "advance on these arguments")
    if found.error is not None:
        raise RemoteExecutionError(f"{label} refused before running: its arguments fail the shape checks: "
                                   f"{found.error}")
    if max_elements and found.max_elements > max_elements:
        raise _too_many(label, "an output", found.max_elements, max_elements)
    if remaining_bytes is not None and found.new_bytes > remaining_bytes:
        raise over_quota(label, found.new_bytes, remaining_bytes)
    return found
