"""Argument checks for allowed ops whose kernels trust their arguments (run by the pre-flight).

Most kernels check their arguments, and the pre-flight's meta run catches most
malformed shapes. The ops here are the reviewed exceptions on the allow-list
whose CPU kernels read or write out of bounds, or crash, on arguments their
own checks miss (found by tests/security/fuzz_ops.py and issue 11). Each check
is cheap and runs only for its op: a dict lookup by OpOverload for all others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from genie.server import index_checks, shape_checks
from genie.server.index_checks import given_args, schema_args
from genie.server.index_checks import refuse as _fail
from genie.server.outputs import functional_of

Check = Callable[[str, list[Any], dict[str, Any]], None]


def _tensor_lists(args: list[Any], kwargs: dict[str, Any]) -> list[list[torch.Tensor]]:
    values = [*args, *kwargs.values()]
    return [v for v in values if isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v)]


def check_foreach(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_foreach_*``: every non-empty tensor list as long as the first; every tensor on one device."""
    lists = _tensor_lists(args, kwargs)
    if not lists:
        return
    length, device = len(lists[0]), lists[0][0].device
    for i, tensors in enumerate(lists):
        if len(tensors) != length:
            raise _fail(label, f"tensor list {i} has {len(tensors)} tensors, the first has {length}; "
                        "every list must be as long")
        for t in tensors:
            if t.device != device:
                raise _fail(label, f"tensors on {t.device} and {device}: a foreach op runs on one device")
    for value in [*args, *kwargs.values()]:
        if isinstance(value, list) and value and not all(isinstance(t, torch.Tensor) for t in value) \
                and len(value) != length:
            raise _fail(label, f"a list of {len(value)} scalars for {length} tensors")


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive slots, in some order of its dimensions."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_fused_optimizer(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_fused_adam(w)_`` / ``_fused_sgd_`` / ``_fused_adagrad_``: the foreach rules, each index the same
    shape, dtype and strides across the lists, dense and non-overlapping (the CPU kernels walk each tensor
    as ``numel`` elements from its data pointer: an expanded parameter was written past its storage and
    killed the session's worker), state steps of one element, momentum buffers present when momentum is
    used, scalar tensors for ``grad_scale`` / ``found_inf`` / a tensor ``lr``."""
    check_foreach(label, args, kwargs)
    lists = [v for v in args if isinstance(v, list)]
    params = lists[0] if lists else []
    sgd = "sgd" in label
    steps_at = 3 if "adagrad" in label else None if sgd else 5
    for p in params:
        if isinstance(p, torch.Tensor) and not dense(p):
            raise _fail(label, f"a parameter of shape {list(p.shape)} and strides {list(p.stride())} overlaps "
                        "itself or has gaps; fused optimizers take dense parameters (clone it, or use foreach=True)")
    for i, tensors in enumerate(lists[1:], 1):
        if not tensors:
            if sgd and i == 2 and kwargs.get("momentum", 0) and params:
                raise _fail(label, "momentum is set but momentum_buffer_list is empty")
            continue
        if len(tensors) != len(params):
            raise _fail(label, f"list {i} has {len(tensors)} tensors for {len(params)} parameters")
        steps = i == steps_at
        for p, t in zip(params, tensors, strict=True):
            if steps:
                if t.numel() != 1:
                    raise _fail(label, f"a state step must have one element, got shape {list(t.shape)}")
            elif t.shape != p.shape or t.dtype != p.dtype:
                raise _fail(label, f"list {i} holds a {t.dtype} {list(t.shape)} for a {p.dtype} {list(p.shape)} "
                            "parameter")
            elif t.stride() != p.stride():
                raise _fail(label, f"list {i} holds a tensor of strides {list(t.stride())} for a parameter of "
                            f"strides {list(p.stride())}; fused optimizers take every state in its parameter's layout")
    for name in ("grad_scale", "found_inf", "lr"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise _fail(label, f"{name} must have one element, got shape {list(value.shape)}")


def check_embedding_bag_psw_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, pad)``:
    the embedding rules (:func:`check_embedding`), then, as its CPU kernel indexes ``grad`` by ``offset2bag``
    and ``weight`` by ``indices`` unchecked (it read another session's memory): both in range, and as many
    bags per index."""
    check_embedding(label, args, kwargs)
    if len(args) < 5 or not all(isinstance(a, torch.Tensor) for a in args[:5]):
        return  # the schema check refuses it
    grad, weight, indices, offsets, offset2bag = args[:5]
    if grad.dim() != 2 or weight.dim() != 2 or indices.dim() != 1 or offset2bag.dim() != 1 or offsets.dim() != 1:
        raise _fail(label, "grad and weight must be 2-d, indices, offsets and offset2bag 1-d")
    built = offset2bag.numel() == 0 and indices.numel() > 0  # the kernel builds offset2bag from the offsets
    if built:
        _check_bags_from_offsets(label, grad, indices, offsets)
    if (offset2bag.numel() != indices.numel() and not built) or grad.size(1) != weight.size(1):
        raise _fail(label, f"offset2bag has {offset2bag.numel()} entries for {indices.numel()} indices, or grad "
                    f"and weight differ in width ({grad.size(1)} vs {weight.size(1)})")
    checked = [("indices", indices, weight.size(0))] + ([] if built else [("offset2bag", offset2bag, grad.size(0))])
    for name, index, bound in checked:  # integers: check_embedding refused any other dtype
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= bound):
            raise _fail(label, f"{name} holds values outside [0, {bound})")


def _check_bags_from_offsets(label: str, grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor) -> None:
    """An empty offset2bag (the CPU sum fast path returns one): the kernel builds it from ``offsets``
    (ones at each offset, cumulated, minus one) and reads ``grad`` by it, so offsets must start at 0, lie
    in [0, len(indices)], and the bags they make must be rows of ``grad``."""
    n = indices.numel()
    if offsets.numel() == 0 or int(offsets[0]) != 0 or int(offsets.min()) < 0 or int(offsets.max()) > n:
        raise _fail(label, f"offsets must start at 0 and lie in [0, {n}] to make offset2bag")
    bags = int((offsets < n).sum())
    if bags > grad.size(0):
        raise _fail(label, f"offsets make {bags} bags for a grad of {grad.size(0)} rows")


#: The embedding ops :func:`check_embedding` covers, with their argument names (from their schemas).
_EMBEDDING_ARGS: dict[str, tuple[str, ...]] = {
    f"aten::{name}": schema_args(name)
    for name in ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only", "_embedding_bag_backward",
                 "_embedding_bag_per_sample_weights_backward", "embedding_dense_backward")
}
_INDEX_ARGS = ("indices", "offsets", "offset2bag", "bag_size", "maximum_indices")


def check_embedding(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """The embedding ops' CPU kernels read their index tensors as flat arrays and trust ``mode``: an expanded
    (stride 0) offsets of 2**20 elements over one element read past its storage, a float offsets or a mode
    of 2**62 killed the process (found by tests/security/fuzz_ops.py). So: index tensors integer and
    contiguous (an argument that is not is served as a contiguous copy, as CUDA's kernels take any layout),
    per-sample weights contiguous likewise, ``mode`` 0 (sum), 1 (mean) or 2 (max); and with
    ``include_last_offset`` at least two offsets (one offset makes no bag and the kernel wrote past its
    empty output); 1-d indices with no offsets at all are refused too (with a weight that is not contiguous,
    or in max mode, the kernel wrote past its empty output: SIGSEGV)."""
    names = _EMBEDDING_ARGS.get(label.split(".", 1)[0])
    if names is None:
        return
    given = given_args(names, args, kwargs)
    for name in (*_INDEX_ARGS, "per_sample_weights"):
        t = given.get(name)
        if not isinstance(t, torch.Tensor):
            continue
        if name != "per_sample_weights" and t.dtype not in (torch.int32, torch.int64):
            raise _fail(label, f"{name} must be int32 or int64, got {t.dtype}")
        if not t.is_contiguous():  # the kernels read it as a flat array; CUDA's take any layout
            _contiguous_arg(names, name, args, kwargs)
    mode = given.get("mode")
    if mode is not None and mode not in (0, 1, 2):
        raise _fail(label, f"mode {mode!r} is none of 0 (sum), 1 (mean), 2 (max)")
    offsets, indices = given.get("offsets"), given.get("indices")
    if not (isinstance(offsets, torch.Tensor) and isinstance(indices, torch.Tensor) and indices.numel()):
        return
    if given.get("include_last_offset") and offsets.numel() < 2:
        raise _fail(label, f"include_last_offset with {offsets.numel()} offset(s) makes no bag for "
                    f"{indices.numel()} indices; give at least two offsets (the last one closes the last bag)")
    if indices.dim() == 1 and not offsets.numel():
        raise _fail(label, f"{indices.numel()} indices and no offsets make no bag; give the offset where each bag "
                    "starts, beginning with 0")
    if indices.dim() == 1 and offsets.dim() == 1:
        _check_offsets(label, offsets, indices.numel())
    weight = given.get("weight")
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        index_checks.in_range(label, "indices", indices, 0, weight.size(0))
    elif isinstance(given.get("num_weights"), int):
        index_checks.in_range(label, "indices", indices, 0, given["num_weights"])


#: CUDA's ``embedding_dense_backward`` takes its feature kernel for at most this many indices (without
#: ``scale_grad_by_freq``); that kernel casts each index to ``int``.
_CUDA_FEATURE_KERNEL_MAX_INDICES = 3072


def embedding_backward_reads_indices(device_type: str, scale_grad_by_freq: bool) -> bool:
    """Whether :func:`check_embedding_dense_backward` must read the indices (a min and a max) on a device of
    ``device_type``: everywhere but on CPU, and on CPU with ``scale_grad_by_freq`` (that function says why)."""
    return device_type != "cpu" or scale_grad_by_freq


def check_embedding_dense_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)``: the
    embedding rules (:func:`check_embedding`), then, where the kernel would write by an index it never checks
    (:func:`embedding_backward_reads_indices`), every index in [0, num_weights).

    CUDA (aten/src/ATen/native/cuda/Embedding.cu, ``embedding_dense_backward_cuda``): up to 3072 indices without
    ``scale_grad_by_freq`` go to ``embedding_backward_feature_kernel``, which adds into
    ``grad_weight[dst_row*stride + f]`` with ``dst_row = (int)indices[i]``; more indices go to
    ``embedding_backward_cuda_kernel`` (EmbeddingBackwardKernel.cu), whose ``sum_and_scatter`` writes
    ``gradWeight[target_row * stride + startFeature]`` for each unique sorted index. Neither has a bound check or
    a ``CUDA_KERNEL_ASSERT``: an index outside the rows is a write outside the result, on the GPU, in the session
    worker's CUDA context (which also maps its pinned host staging). The feature kernel's ``int`` cast wraps an
    index of 2**31 or more to another row, so there the bound is also 2**31. Any device but CPU is checked: a
    ``meta`` stand-in for an intermediate (genie.server.replay_checks) cannot be read, so such a graph checks the
    node eagerly rather than trusting it.

    CPU (aten/src/ATen/native/Embedding.cpp, ``embedding_dense_backward_cpu``): each thread adds only the rows
    ``k`` with ``start <= k < end`` of its share of [0, num_weights), so an index outside is skipped (index 10
    with num_weights 10: a [10, D] result, nothing written past it). No data is read there: the check would add
    two reads per op on the training hot path. But with ``scale_grad_by_freq`` the kernel first counts each
    index in ``counts[indices_data[i]]++``, a heap array of num_weights entries, unchecked: 10**11 was a SIGSEGV
    and 10 a silent write past it. So with ``scale_grad_by_freq`` CPU reads the indices too.

    ``padding_idx`` is any value: both devices only compare each index with it and skip the equal ones, a
    skipped row is no hazard. No index is exempted for being ``padding_idx``: torch's ``F.embedding`` sends -1 or
    a row of the weight, and CUDA compares an ``int``-cast ``padding_idx`` (2**32 - 1 becomes -1) with the
    int64 index in ``sum_and_scatter``, so exempting an out-of-range ``padding_idx`` would let it write."""
    check_embedding(label, args, kwargs)
    given = given_args(_EMBEDDING_ARGS["aten::embedding_dense_backward"], args, kwargs)
    indices, num_weights = given.get("indices"), given.get("num_weights")
    by_freq = bool(given.get("scale_grad_by_freq", False))
    if not isinstance(indices, torch.Tensor) or not isinstance(num_weights, int) \
            or not embedding_backward_reads_indices(indices.device.type, by_freq):
        return
    high = num_weights
    if indices.device.type != "cpu" and not by_freq and indices.numel() <= _CUDA_FEATURE_KERNEL_MAX_INDICES:
        high = min(high, 1 << 31)  # the feature kernel's (int) cast
    index_checks.in_range(label, "indices", indices, 0, high)


def _check_offsets(label: str, offsets: torch.Tensor, n: int) -> None:
    """Offsets of bags over ``n`` indices: from 0, never decreasing, at most ``n``. The CPU kernel reads
    ``indices`` at each offset unchecked: a negative offset read the word before its buffer and printed it in its
    error message (issue 28: an 8-byte heap word, in decimal), a decreasing one walked past the bag."""
    if int(offsets[0]) != 0 or int(offsets.min()) < 0 or int(offsets.max()) > n:
        raise _fail(label, f"offsets must start at 0 and lie in [0, {n}] (the bags of {n} indices)")
    if offsets.numel() > 1 and not bool((offsets.diff() >= 0).all()):
        raise _fail(label, "offsets must not decrease (each is where a bag starts)")


def check_index_put_impl(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_index_put_impl_(self, indices, values, accumulate, unsafe)``: ``unsafe=True`` (what autograd's
    backward of ``x[idx]`` sends) lets a kernel skip the index checks the public ``index_put_`` keeps. It is
    served as ``unsafe=False``: the same result for indices in range, the kernel's error naming the index
    otherwise. (The one check that rewrites an argument; the argument lists are the call's own.)"""
    if len(args) > 4:
        if args[4]:
            args[4] = False
    elif kwargs.get("unsafe"):
        kwargs["unsafe"] = False  # a plan's template too: every call of that plan sends unsafe=True


def check_batch_norm(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``native_batch_norm`` and kin: the CPU kernel indexes weight, bias and the running and saved
    statistics by channel unchecked (a 1-element running_mean for 3 channels read past it): each one given
    must be 1-d with one element per channel (``input.size(1)``), and the input at least 2-d. Outside
    training a backward reads the running statistics, not the saved ones, which the forward returned
    empty (``train``/``update`` False: empty saved statistics are accepted)."""
    backward = "backward" in label
    tensors = [a for a in args if isinstance(a, torch.Tensor) or a is None]
    start = 2 if backward else 1
    if len(tensors) < start or tensors[start - 1] is None:
        return  # the schema check refuses it
    x = tensors[start - 1]
    assert isinstance(x, torch.Tensor)
    if x.dim() < 2:
        raise _fail(label, f"the input must have a batch and a channel dimension, got shape {list(x.shape)}")
    if backward and isinstance(tensors[0], torch.Tensor) and tensors[0].shape != x.shape:
        raise _fail(label, f"grad_out {list(tensors[0].shape)} and input {list(x.shape)} differ")
    channels = x.size(1)
    # backward: weight, running mean and var, saved mean and invstd (batch_norm_backward's reserve follows)
    per_channel = tensors[start:start + 5] if backward else tensors[start:]
    training = args[7] if len(args) > 7 else kwargs.get("train", kwargs.get("update", True))
    for position, t in enumerate(per_channel):
        if t is None or backward and position >= 3 and not training and t.numel() == 0:
            continue
        if t.dim() != 1 or t.numel() != channels:
            raise _fail(label, f"a per-channel tensor of shape {list(t.shape)} for {channels} channels")


def check_cum_helper(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_cummax_helper`` / ``_cummin_helper(self, values, indices, dim)``: the CPU kernel walks ``self`` and
    writes ``values`` and ``indices`` at the same positions unchecked (a 1-element ``values`` for a larger
    ``self`` killed the process): both must have ``self``'s shape, ``values`` its dtype, ``indices`` int64."""
    values = [*args, *kwargs.values()]
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    if len(tensors) < 3:
        return  # the schema check refuses it
    x, out, indices = tensors[:3]
    if out.shape != x.shape or indices.shape != x.shape:
        raise _fail(label, f"values {list(out.shape)} and indices {list(indices.shape)} must both have the "
                    f"input's shape {list(x.shape)}")
    if out.dtype != x.dtype or indices.dtype != torch.int64:
        raise _fail(label, f"values must be {x.dtype} (got {out.dtype}) and indices torch.int64 (got {indices.dtype})")


#: Most elements of the n**r grid torch's ``combinations`` kernel builds (meshgrid of r copies of the input,
#: then an n**r mask), whatever the r-combinations it returns: 64 M, a 2**26-byte mask.
MAX_COMBINATION_GRID = 1 << 26


def check_combinations(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``combinations(self, r, with_replacement)``: its kernel (and its meta run, which is the same
    decomposition) makes r tensors and an n**r mask before it selects anything, so r = 2**31 built a list
    of 2**31 tensors in the pre-flight (found by tests/security/fuzz_ops.py). Refused when n**r passes
    :data:`MAX_COMBINATION_GRID` (a pre-check: it runs before the meta run and reads no data)."""
    given = given_args(("self", "r", "with_replacement"), args, kwargs)
    x, r = given.get("self"), given.get("r", 2)
    if not isinstance(x, torch.Tensor) or not isinstance(r, int) or r <= 0:
        return  # the kernel's own checks answer (r < 0 is its error; r == 0 is empty)
    n = x.numel()
    if r > 64:  # torch makes r tensors whatever n is
        raise _fail(label, f"combinations with r = {r}: torch's kernel makes r tensors first; r may be at most 64")
    if n > 1 and r * math.log2(n) > math.log2(MAX_COMBINATION_GRID):
        raise _fail(label, f"combinations of {n} elements taken {r} at a time builds a grid of {n}**{r} elements "
                    f"first (torch's kernel), more than {MAX_COMBINATION_GRID}; take fewer elements or a smaller r")


def check_median_dim(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``median.dim`` / ``nanmedian.dim`` (and their out forms): the CPU kernel walks the reduced dimension as if
    its elements were distinct, so an expanded input (stride 0 along that dim) read past its storage: garbage
    values from the worker's heap for 100 elements over 12, a SIGSEGV for 2**26 (found by the fuzzer). Such an
    input is served as a contiguous copy (what CUDA's kernel takes as it is)."""
    given = given_args(("self", "dim", "keepdim"), args, kwargs)
    x, dim = given.get("self"), given.get("dim")
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or not -x.dim() <= dim < max(x.dim(), 1):
        return  # the full reduction, or the kernel's own dim check answers
    if x.dim() and x.stride(dim) == 0 and x.size(dim) > 1:  # CUDA's kernel takes it: served as a copy
        _contiguous_arg(("self", "dim", "keepdim"), "self", args, kwargs)


#: Out forms whose kernel has no meta twin but checks its out dtypes itself (tests/security/test_kernel_bounds.py
#: proves each refuses a mismatching one), and whose outputs do not all take the input's dtype: the rule below
#: would refuse every call of theirs (a rank is int64, a reserve uint8).
KERNEL_CHECKS_OUT_DTYPES = frozenset({"aten::linalg_lstsq.out", "aten::_batch_norm_with_update.out",
                                      "aten::_native_batch_norm_legit.out"})
_META = torch.device("meta")


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=_META)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, torch.Generator):
        return None
    return value


def _computed_dtypes(functional: Any, args: list[Any], kwargs: dict[str, Any]) -> list[torch.dtype | None] | None:
    """The dtypes of ``functional``'s results on meta copies of the arguments, or None when it has no meta
    kernel or refuses them (the kernel's own checks then answer)."""
    if functional is None:
        return None
    try:
        result = functional(*_to_meta(args), **{k: _to_meta(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - no meta kernel (NotImplementedError), or the arguments fail its checks
        return None
    results = result if isinstance(result, (list, tuple)) else [result]
    return [t.dtype if isinstance(t, torch.Tensor) else None for t in results]


def _unchecked_out_form(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` is an out form that only a backend kernel implements: no meta kernel (the pre-flight's meta
    run checks the out dtypes of every structured op and Python meta registration), no composite one (the
    generated out forms copy a functional result into ``out``, casting; CompositeImplicit ones call out forms
    checked in turn)."""
    name = op.name()
    if not any(a.is_out for a in op._schema.arguments) or name in KERNEL_CHECKS_OUT_DTYPES:
        return False
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return not any(has(name, key) for key in ("Meta", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
                                              "CompositeExplicitAutogradNonFunctional"))


def out_dtype_check(op: torch._ops.OpOverload) -> Check | None:
    """The out-dtype rule of ``op`` (None for every op it does not cover; cached): see :func:`check_out_dtypes`."""
    try:
        return _out_rules[op]
    except KeyError:
        pass
    found: Check | None = None
    if _unchecked_out_form(op):
        out_names = [a.name for a in op._schema.arguments if a.is_out]
        names = tuple(a.name for a in op._schema.arguments if not a.is_out)
        functional = functional_of(op)[1]

        def found(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
            check_out_dtypes(label, args, kwargs, names=names, out_names=out_names, functional=functional)

    _out_rules[op] = found
    return found


_out_rules: dict[torch._ops.OpOverload, Check | None] = {}


def check_out_dtypes(label: str, args: list[Any], kwargs: dict[str, Any], *, names: tuple[str, ...],
                     out_names: list[str], functional: Any) -> None:
    """An out form that only a backend kernel implements (no meta or composite kernel checks its out dtypes) may
    write what it computes into ``out`` as its own dtype, whatever ``out``'s: ``_logcumsumexp.out`` with a float
    input and a uint8 out wrote 96 bytes into a 24-byte buffer (issue 28; the worker aborted). So each out
    tensor must have the dtype the op computes: its functional form's, worked out on meta tensors, or, where
    that has no meta kernel, the first tensor input's (every such kernel dispatches on it)."""
    given = dict(zip(names, args, strict=False))
    outs = [kwargs.get(n) for n in out_names]
    if not all(isinstance(t, torch.Tensor) for t in outs):
        return  # the schema check refuses it
    inputs = {k: v for k, v in kwargs.items() if k not in out_names}
    expected: list[torch.dtype | None] | None = _computed_dtypes(functional, args, inputs)
    if expected is None or len(expected) != len(outs):
        first = next((v for v in [*given.values(), *inputs.values()] if isinstance(v, torch.Tensor)), None)
        if first is None:
            return  # a factory: its kernel writes in the out's dtype
        expected = [first.dtype] * len(outs)
    for name, out, dtype in zip(out_names, outs, expected, strict=True):
        assert isinstance(out, torch.Tensor)
        if dtype is not None and out.dtype != dtype:
            raise _fail(label, f"out argument {name!r} is {out.dtype} but the op computes {dtype}, and this op's "
                        f"kernel does not convert; pass a {dtype} {name} (and convert the result afterwards)")


def _contiguous_arg(names: tuple[str, ...], name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Replace the input argument ``name`` by a contiguous copy, in the call's own argument lists (a plan's are
    copies per call: genie.server.plans._arguments). Only for inputs a kernel reads: an output must stay the
    session's tensor. The copy has the input's elements, which the pre-flight's element cap bounds."""
    if name in kwargs:
        kwargs[name] = kwargs[name].contiguous()
    else:
        position = names.index(name)
        args[position] = args[position].contiguous()


#: Checks that read only what a command plan's key fixes: ranks, shapes and dtypes of the op's tensors and its
#: non-float arguments; never data, floats or where a storage lives (check_foreach compares devices: not here). A
#: plan is made from a command the full path checked, so a later command with its key passes these too: its plan
#: skips them (genie.server.plans) and may run in C++. Batch norm's check ran on every call of a ResNet's 104
#: batch-norm commands a training step, which kept them from the native runner.
KEY_FIXED: frozenset[Check] = frozenset({check_batch_norm, check_cum_helper})


#: Checks that must run before the pre-flight's meta run (they read no data): the meta run itself would fail.
PRE_CHECKS: dict[str, Check] = {"aten::combinations": check_combinations, **shape_checks.PRE_CHECKS}


#: Checks by op packet name (``aten::_foreach_add_`` covers all its overloads).
_BY_PACKET: dict[str, Check] = {
    "aten::_fused_adam_": check_fused_optimizer,
    "aten::_fused_adamw_": check_fused_optimizer,
    "aten::_fused_sgd_": check_fused_optimizer,
    "aten::_fused_adagrad_": check_fused_optimizer,
    "aten::_embedding_bag_per_sample_weights_backward": check_embedding_bag_psw_backward,
    "aten::_index_put_impl_": check_index_put_impl,
    "aten::embedding_bag": check_embedding,
    "aten::_embedding_bag": check_embedding,
    "aten::_embedding_bag_forward_only": check_embedding,
    "aten::_embedding_bag_backward": check_embedding,
    "aten::embedding_dense_backward": check_embedding_dense_backward,
    "aten::median": check_median_dim,
    "aten::nanmedian": check_median_dim,
    "aten::_cummax_helper": check_cum_helper,
    "aten::_cummin_helper": check_cum_helper,
    "aten::native_batch_norm": check_batch_norm,
    "aten::cudnn_batch_norm": check_batch_norm,
    "aten::native_batch_norm_backward": check_batch_norm,
    "aten::_native_batch_norm_legit": check_batch_norm,
    "aten::_native_batch_norm_legit_no_training": check_batch_norm,
    "aten::_native_batch_norm_legit_functional": check_batch_norm,
    "aten::_batch_norm_with_update": check_batch_norm,
    "aten::_batch_norm_with_update_functional": check_batch_norm,
    "aten::_batch_norm_no_update": check_batch_norm,
    "aten::batch_norm_backward": check_batch_norm,
    **index_checks.BY_PACKET,
    **shape_checks.BY_PACKET,
}
_cache: dict[torch._ops.OpOverload, Check | None] = {}


def check_for(op: torch._ops.OpOverload) -> Check | None:
    """The check of ``op``, or None (cached per overload)."""
    try:
        return _cache[op]
    except KeyError:
        packet = op.name().split(".", 1)[0]
        found = _BY_PACKET.get(packet) or (check_foreach if packet.startswith("aten::_foreach_") else None)
        out_rule = out_dtype_check(op)
        if out_rule is not None:
            found = out_rule if found is None else _both(found, out_rule)
        _cache[op] = found
        return found


def _both(first: Check, second: Check) -> Check:
    def check(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        first(label, args, kwargs)
        second(label, args, kwargs)
    return check


def pre_check_for(op: torch._ops.OpOverload) -> Check | None:
    """The check of ``op`` that runs before its meta run (:data:`PRE_CHECKS`), or None."""
    return PRE_CHECKS.get(op.name().split(".", 1)[0])
