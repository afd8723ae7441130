"""Argument checks for allowed ops whose CPU kernels index memory by the client's data or trust a shape.

The max-pooling backward kernels add ``grad_output`` at the flat position each
``indices`` element names, the CTC loss reads ``log_probs`` at each target's class,
the segment-reduce backward walks ``data`` by ``lengths`` or ``offsets``, and the
distance and unfold backward kernels read ``grad`` by the shape the forward would
have made: none of them checks. A hostile index wrote or read another part of the
worker's heap (index 5 into a 4-element plane: a silent write past it; 10**11:
SIGSEGV), found by hand and by tests/security/fuzz_ops.py. ``linalg_eigvals``'
LAPACK call crashes on NaN or infinity (``linalg_eig`` refuses those itself),
``bincount`` allocates as many bins as its largest value says, and ``repeat_interleave``
writes each position ``repeats`` names before it checks the counts (a negative count
that still summed to ``output_size`` corrupted the heap: ``free(): invalid pointer``).

Each check reads at most the index tensor (a min and a max) or compares shapes;
:mod:`genie.server.validators` maps ops to them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from genie.errors import RemoteExecutionError

#: Most bins ``bincount`` may allocate (its output is as long as the input's largest value + 1): 2**24
#: (128 MiB of float64 counts). The bins of a classification histogram are far fewer.
MAX_BINCOUNT_BINS = 1 << 24
_INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def refuse(label: str, problem: str) -> RemoteExecutionError:
    """The error of a check: the op and what is wrong, before anything ran."""
    return RemoteExecutionError(f"{label} refused before running: {problem}")


def given_args(op_args: tuple[str, ...], args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op's arguments by name: the positional ones named as ``op_args`` lists them, then the keywords."""
    return dict(zip(op_args, args, strict=False)) | kwargs


def schema_args(name: str, overload: str = "default") -> tuple[str, ...]:
    """The argument names of ``aten::name.overload``, in schema order."""
    return tuple(a.name for a in getattr(getattr(torch.ops.aten, name), overload)._schema.arguments)


def in_range(label: str, name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every element of the integer tensor ``t`` in [low, high)."""
    if t.dtype not in _INTEGER:
        raise refuse(label, f"{name} must be an integer tensor, got {t.dtype}")
    if t.numel() and (int(t.min()) < low or int(t.max()) >= high):
        raise refuse(label, f"{name} holds values outside [{low}, {high})")


def check_pool_indices(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``max_pool{2,3}d_with_indices_backward`` and ``adaptive_max_pool{2,3}d_backward``: the kernel adds each
    ``grad_output`` element at the flat position in its input plane that ``indices`` names, unchecked. So
    ``indices`` must be int64 with ``grad_output``'s shape, the two must match the input but for the pooled
    dims, and every index must lie in its plane ([-1, plane) for max pooling, whose kernel skips -1)."""
    spatial = 3 if "3d" in label else 2
    tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
    if len(tensors) < 3:
        return  # the schema check refuses it
    grad, x, indices = tensors[0], tensors[1], tensors[2]
    if indices.dtype != torch.int64 or indices.shape != grad.shape:
        raise refuse(label, f"indices must be int64 with grad_output's shape {list(grad.shape)}, got "
                     f"{indices.dtype} {list(indices.shape)}")
    if x.dim() < spatial or grad.dim() != x.dim() or grad.shape[:-spatial] != x.shape[:-spatial]:
        raise refuse(label, f"grad_output {list(grad.shape)} does not pool input {list(x.shape)} over its last "
                     f"{spatial} dims")
    plane = math.prod(x.shape[-spatial:])
    in_range(label, "indices", indices, 0 if "adaptive" in label else -1, plane)


_CTC_ARGS = schema_args("_ctc_loss")
_CTC_BACKWARD_ARGS = schema_args("_ctc_loss_backward")


def _lengths(value: Any) -> list[int] | None:
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()] if value.dtype in _INTEGER else None
    return list(value) if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value) else None


def check_ctc(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_ctc_loss`` / ``_ctc_loss_backward`` (both overloads): the kernel reads ``log_probs`` at each target's
    class unchecked (a target of 10**11 was SIGSEGV, -5 read outside it). The targets each batch element
    uses (``target_lengths`` of them: a row of 2-d targets, or its share of 1-d concatenated ones) must be
    classes, in [0, C); the backward's ``neg_log_likelihood``, ``log_alpha`` and ``grad`` must have the
    shapes the forward made, which its kernel reads by. Lengths, blank and ``log_probs`` are the kernel's own
    checks."""
    backward = "backward" in label
    given = given_args(_CTC_BACKWARD_ARGS if backward else _CTC_ARGS, args, kwargs)
    log_probs, targets = given.get("log_probs"), given.get("targets")
    target_lengths, input_lengths = _lengths(given.get("target_lengths")), _lengths(given.get("input_lengths"))
    if not isinstance(log_probs, torch.Tensor) or not isinstance(targets, torch.Tensor) or target_lengths is None \
            or input_lengths is None or log_probs.dim() not in (2, 3):
        return  # the schema check or the kernel's own checks answer
    classes = log_probs.size(-1)
    if any(n < 0 for n in [*target_lengths, *input_lengths]):
        raise refuse(label, "input and target lengths must be at least 0")
    if targets.dim() == 2:
        width = targets.size(1)
        if any(n > width for n in target_lengths) or len(target_lengths) != targets.size(0):
            raise refuse(label, f"2-d targets {list(targets.shape)} need one row per batch element, each at least "
                         f"as long as its target length ({len(target_lengths)} lengths, the longest "
                         f"{max(target_lengths, default=0)})")
        used = torch.arange(width) < torch.tensor(target_lengths).unsqueeze(1)
        in_range(label, "targets", targets[: len(target_lengths)][used], 0, classes)
    elif targets.dim() == 1:
        total = sum(target_lengths)
        if total > targets.numel():
            raise refuse(label, f"target_lengths add up to {total}, more than the {targets.numel()} targets")
        in_range(label, "targets", targets[:total], 0, classes)
    else:
        raise refuse(label, f"targets must be 1-d (concatenated) or 2-d (padded), got shape {list(targets.shape)}")
    if backward:
        batch = len(input_lengths)
        steps = log_probs.size(0)
        expect: dict[str, list[tuple[int, ...]]] = {
            "grad": [(batch,), ()], "neg_log_likelihood": [(batch,), ()],
            "log_alpha": [(batch, steps, 2 * max(target_lengths, default=0) + 1)]}
        for name, shapes in expect.items():
            t = given.get(name)
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in shapes:
                raise refuse(label, f"{name} of shape {list(t.shape)}, the forward made {list(shapes[0])}")


_SEGMENT_BACKWARD_ARGS = schema_args("_segment_reduce_backward")


def check_segment_reduce_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_segment_reduce_backward(grad, output, data, reduce, lengths, offsets, axis, initial)``: the kernel
    walks ``data`` by the segments and reads ``grad`` and ``output`` per segment, trusting all of them (a
    length of 10**6 over 2 elements was SIGSEGV). The segments must lie inside ``data`` along ``axis``
    (lengths at least 0 adding up to at most its size, as ``unsafe=True`` forwards may leave a tail; offsets
    in [0, size], never decreasing), one row of them per position of the leading dims, and ``grad`` and
    ``output`` must have the forward's output shape."""
    given = given_args(_SEGMENT_BACKWARD_ARGS, args, kwargs)
    grad, output, data = given.get("grad"), given.get("output"), given.get("data")
    lengths, offsets, axis = given.get("lengths"), given.get("offsets"), given.get("axis", 0)
    if not all(isinstance(t, torch.Tensor) for t in (grad, output, data)) or not isinstance(axis, int):
        return  # the schema check refuses it
    assert isinstance(data, torch.Tensor) and isinstance(grad, torch.Tensor) and isinstance(output, torch.Tensor)
    if not -data.dim() <= axis < max(data.dim(), 1) or data.dim() == 0:
        raise refuse(label, f"axis {axis} is not a dim of data of shape {list(data.shape)}")
    axis %= data.dim()
    segments = lengths if isinstance(lengths, torch.Tensor) else offsets
    if not isinstance(segments, torch.Tensor):
        raise refuse(label, "give lengths or offsets")
    name = "lengths" if segments is lengths else "offsets"
    if segments.dim() != axis + 1 or segments.shape[:-1] != data.shape[:axis]:
        raise refuse(label, f"{name} of shape {list(segments.shape)} for data {list(data.shape)} along axis {axis}: "
                     "one row of segments per position of the dims before the axis")
    size = data.size(axis)
    in_range(label, name, segments, 0, size + 1)
    if name == "lengths":
        count = segments.size(-1)
        if segments.numel() and not bool((segments.sum(-1) <= size).all()):
            raise refuse(label, f"lengths add up to more than data's size {size} along axis {axis}")
    else:
        count = segments.size(-1) - 1
        if count < 0 or segments.numel() and not bool((segments.diff(dim=-1) >= 0).all()):
            raise refuse(label, "offsets must not decrease")
    shape = [*data.shape[:axis], count, *data.shape[axis + 1:]]
    for t, what in ((grad, "grad"), (output, "output")):
        if list(t.shape) != shape:
            raise refuse(label, f"{what} of shape {list(t.shape)}, the forward made {shape}")


def check_finite_eigvals(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``linalg_eigvals`` / ``_linalg_eigvals``: LAPACK's balancing step (``?gebal``) crashed the process on a
    matrix with NaN or infinity (found by the fuzzer; ``linalg_eig`` refuses such input itself)."""
    x = args[0] if args else kwargs.get("self")
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel() \
            and not bool(torch.isfinite(x).all()):
        raise refuse(label, "the input holds NaN or infinity, on which LAPACK's eigenvalue routine crashes; "
                     "torch.linalg.eig refuses such input too")


_PDIST_BACKWARD_ARGS = schema_args("_pdist_backward")
_CDIST_BACKWARD_ARGS = schema_args("_cdist_backward")


def check_pdist_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_pdist_backward(grad, self, p, pdist)``: the kernel reads ``grad`` and ``pdist`` at every pair of
    ``self``'s rows (a 1-element grad for 100 rows read past it): both must have n(n-1)/2 elements."""
    given = given_args(_PDIST_BACKWARD_ARGS, args, kwargs)
    x, grad, pdist = given.get("self"), given.get("grad"), given.get("pdist")
    if not all(isinstance(t, torch.Tensor) for t in (x, grad, pdist)):
        return
    assert isinstance(x, torch.Tensor) and isinstance(grad, torch.Tensor) and isinstance(pdist, torch.Tensor)
    if x.dim() != 2:
        raise refuse(label, f"self must be 2-d, got shape {list(x.shape)}")
    pairs = (x.size(0) * (x.size(0) - 1) // 2,)
    for t, what in ((grad, "grad"), (pdist, "pdist")):
        if tuple(t.shape) != pairs:
            raise refuse(label, f"{what} of shape {list(t.shape)}: {x.size(0)} rows make {pairs[0]} pairs")


def check_cdist_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_cdist_backward(grad, x1, x2, p, cdist)``: the kernel reads ``grad`` and ``cdist`` by the shapes of
    x1 and x2: x1 (..., r1, m) and x2 (..., r2, m) with batch dims that broadcast, grad and cdist (batch, r1, r2)."""
    given = given_args(_CDIST_BACKWARD_ARGS, args, kwargs)
    x1, x2, grad, cdist = given.get("x1"), given.get("x2"), given.get("grad"), given.get("cdist")
    if not all(isinstance(t, torch.Tensor) for t in (x1, x2, grad, cdist)):
        return
    assert isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)
    assert isinstance(grad, torch.Tensor) and isinstance(cdist, torch.Tensor)
    try:
        if x1.dim() < 2 or x2.dim() < 2 or x1.size(-1) != x2.size(-1):
            raise RuntimeError("not matrices of one width")
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    except RuntimeError:
        raise refuse(label, f"x1 {list(x1.shape)} and x2 {list(x2.shape)} must be (..., r1, m) and (..., r2, m) "
                     "with batch dims that broadcast") from None
    shape = (*batch, x1.size(-2), x2.size(-2))
    for t, what in ((grad, "grad"), (cdist, "cdist")):
        if tuple(t.shape) != shape:
            raise refuse(label, f"{what} of shape {list(t.shape)}, the forward made {list(shape)}")


def check_unfold_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``unfold_backward(grad_in, input_sizes, dim, size, step)``: the kernel reads ``grad_in`` by the windows
    ``input_sizes.unfold(dim, size, step)`` makes; ``grad_in`` must have exactly that shape."""
    given = given_args(("grad_in", "input_sizes", "dim", "size", "step"), args, kwargs)
    grad, sizes = given.get("grad_in"), given.get("input_sizes")
    dim, size, step = given.get("dim"), given.get("size"), given.get("step")
    if not isinstance(grad, torch.Tensor) or not isinstance(sizes, (list, tuple)) \
            or not all(isinstance(v, int) for v in (dim, size, step, *sizes)):
        return
    assert isinstance(dim, int) and isinstance(size, int) and isinstance(step, int)
    try:
        shape = torch.empty(list(sizes), device="meta").unfold(dim, size, step).shape
    except (RuntimeError, IndexError, ValueError) as exc:
        raise refuse(label, f"input_sizes {list(sizes)} cannot be unfolded so: {exc}") from None
    if grad.shape != shape:
        raise refuse(label, f"grad_in of shape {list(grad.shape)}, unfolding {list(sizes)} makes {list(shape)}")


def check_bincount(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``bincount(self, weights, minlength)``: its output has max(self) + 1 or ``minlength`` bins, allocated
    by the data (2**40 asked the allocator for 8 TiB): at most :data:`MAX_BINCOUNT_BINS`."""
    given = given_args(("self", "weights", "minlength"), args, kwargs)
    x, minlength = given.get("self"), given.get("minlength", 0)
    if isinstance(minlength, int) and minlength > MAX_BINCOUNT_BINS:
        raise refuse(label, f"minlength {minlength} is more than {MAX_BINCOUNT_BINS} bins")
    if isinstance(x, torch.Tensor) and x.dtype in _INTEGER and x.numel() and int(x.max()) >= MAX_BINCOUNT_BINS:
        raise refuse(label, f"its largest value {int(x.max())} would make more than {MAX_BINCOUNT_BINS} bins")


#: The checks of this module by op packet name, for :mod:`genie.server.validators`.
def check_repeat_interleave(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``repeat_interleave.Tensor(repeats, *, output_size)``: the CPU kernel allocates ``output_size`` elements
    and writes index ``i`` at the positions ``repeats``' running sum gives, checking the counts only after (a
    negative count that still summed to ``output_size`` corrupted the heap). So ``output_size`` must be given
    (genie's client sends it; without it the output's size is the data's, which no pre-flight can bound),
    ``repeats`` 1-dim integers, each in [0, output_size], summing to exactly ``output_size`` (in float64 where an
    int64 sum could wrap around). ``self_int`` (a number of repeats) needs none of this."""
    repeats = kwargs["repeats"] if "repeats" in kwargs else args[1] if len(args) > 1 else args[0] if args else None
    if not isinstance(repeats, torch.Tensor):
        return  # self_int, or the schema check refuses it
    size = kwargs.get("output_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise refuse(label, "repeat_interleave with a repeats tensor needs output_size (the sum of repeats): the "
                     "output's size cannot be worked out in advance otherwise; pass output_size=int(repeats.sum())")
    if repeats.dim() != 1:
        raise refuse(label, f"repeats must be 1-dim, got shape {list(repeats.shape)}")
    if repeats.dtype not in _INTEGER:
        raise refuse(label, f"repeats must be an integer tensor, got {repeats.dtype}")
    count = repeats.numel()
    if count == 0:
        low = high = total = 0
    elif repeats.stride(0) == 0:  # an expanded count: one value read, not 2**26 (the fuzzer's, past the deadline)
        low = high = int(repeats[0])
        total = low * count
    else:
        low_t, high_t = torch.aminmax(repeats)
        low, high = int(low_t), int(high_t)
        # an int64 sum of counts in [0, high] cannot wrap while count * high < 2**63; past that, float64's
        # sum tells a total near output_size from one that wrapped around to it
        total = int(repeats.sum(dtype=torch.int64)) if count * high < 1 << 63 \
            else round(float(repeats.sum(dtype=torch.float64)))
    if low < 0 or high > size:
        raise refuse(label, f"repeats must be counts in [0, output_size={size}]")
    if total != size:
        raise refuse(label, f"repeats sum to {total}, not output_size {size}")


BY_PACKET = {
    "aten::max_pool2d_with_indices_backward": check_pool_indices,
    "aten::max_pool3d_with_indices_backward": check_pool_indices,
    "aten::adaptive_max_pool2d_backward": check_pool_indices,
    "aten::adaptive_max_pool3d_backward": check_pool_indices,
    "aten::_ctc_loss": check_ctc,
    "aten::_ctc_loss_backward": check_ctc,
    "aten::_segment_reduce_backward": check_segment_reduce_backward,
    "aten::linalg_eigvals": check_finite_eigvals,
    "aten::_linalg_eigvals": check_finite_eigvals,
    "aten::_pdist_backward": check_pdist_backward,
    "aten::_cdist_backward": check_cdist_backward,
    "aten::unfold_backward": check_unfold_backward,
    "aten::bincount": check_bincount,
    "aten::repeat_interleave": check_repeat_interleave,
}
