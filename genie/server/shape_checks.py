"""Checks for the kernels allowed for ordinary PyTorch code (issue 29) that trust a shape, size or index the
client gives: the fused RNN cells, ``embedding_renorm_``, ``_cholesky_solve_helper``, ``rrelu_with_noise``,
the fractional max-pooling backward kernels, ``nonzero_static``, ``random_`` and the AMP scaler ops.

Each check refuses only what would make a kernel read or write outside its tensors (or what the kernel
refuses anyway, with a message that says so before it runs); what CUDA takes is taken. Like
:mod:`genie.server.index_checks`, a check receives the op's label and its resolved arguments;
:data:`BY_PACKET` maps op packets to them for :mod:`genie.server.validators`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from genie.server.index_checks import given_args, refuse, schema_args

_INDEX = (torch.int32, torch.int64)
#: Most rows ``nonzero_static`` may be asked for: the pre-flight's default element cap (its output has
#: ``size`` rows of ``self.dim()`` elements; a 0-d input makes ``size`` rows of nothing).
MAX_NONZERO_STATIC_SIZE = (1 << 31) - 1


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


# -- fused RNN cells (what a CUDA server runs for nn.LSTM / nn.GRU; a CPU client decomposes them) ---------
_CELL_ARGS = {name: schema_args(name) for name in (
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell_backward_impl",
    "_thnn_fused_gru_cell_backward")}


def check_rnn_cell(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell(input_gates, hidden_gates, cx|hx, input_bias,
    hidden_bias)``: the kernels walk the gates as (batch, gates * hidden) by the hidden state's shape. So the
    gates must both be 2-d of one shape (B, 4H) for LSTM, (B, 3H) for GRU, the state (B, H), each bias 1-d of
    the gates' width, all of one dtype."""
    lstm = "lstm" in label
    given = given_args(_CELL_ARGS["_thnn_fused_lstm_cell" if lstm else "_thnn_fused_gru_cell"], args, kwargs)
    igates, hgates = given.get("input_gates"), given.get("hidden_gates")
    state = given.get("cx" if lstm else "hx")
    if not all(isinstance(t, torch.Tensor) for t in (igates, hgates, state)):
        return  # the schema check refuses it
    assert isinstance(igates, torch.Tensor) and isinstance(hgates, torch.Tensor) and isinstance(state, torch.Tensor)
    factor = 4 if lstm else 3
    if state.dim() != 2:
        raise refuse(label, f"the hidden state must be 2-d (batch, hidden), got shape {_shape(state)}")
    gates = [state.size(0), factor * state.size(1)]
    for name, t in (("input_gates", igates), ("hidden_gates", hgates)):
        if _shape(t) != gates:
            raise refuse(label, f"{name} of shape {_shape(t)}: a hidden state of shape {_shape(state)} needs "
                         f"gates of shape {gates}")
    for name in ("input_bias", "hidden_bias"):
        bias = given.get(name)
        if isinstance(bias, torch.Tensor) and _shape(bias) != gates[1:]:
            raise refuse(label, f"{name} of shape {_shape(bias)}, the gates need {gates[1:]}")
    _one_dtype(label, [t for t in given.values() if isinstance(t, torch.Tensor)])


def check_rnn_cell_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias)`` and
    ``_thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias)``: the kernels read the workspace the
    forward made by the state's shape: (B, 4H) for LSTM with cx, cy and the gradients (B, H); (B, 5H) for
    GRU with grad_hy (B, H)."""
    lstm = "lstm" in label
    given = given_args(_CELL_ARGS["_thnn_fused_lstm_cell_backward_impl" if lstm
                                  else "_thnn_fused_gru_cell_backward"], args, kwargs)
    workspace = given.get("workspace")
    states = ("grad_hy", "grad_cy", "cx", "cy") if lstm else ("grad_hy",)
    tensors = [(name, given.get(name)) for name in states]
    present = [(name, t) for name, t in tensors if isinstance(t, torch.Tensor)]
    if not isinstance(workspace, torch.Tensor) or not present:
        return  # the schema check refuses it (LSTM: both gradients undefined is the kernel's no-op)
    first = present[0][1]
    if first.dim() != 2:
        raise refuse(label, f"{present[0][0]} must be 2-d (batch, hidden), got shape {_shape(first)}")
    for name, t in present:
        if t.shape != first.shape:
            raise refuse(label, f"{name} of shape {_shape(t)} differs from {present[0][0]}'s {_shape(first)}")
    need = [first.size(0), (4 if lstm else 5) * first.size(1)]
    if _shape(workspace) != need:
        raise refuse(label, f"workspace of shape {_shape(workspace)}, the forward made {need}")
    _one_dtype(label, [workspace, *(t for _, t in present)])


def _one_dtype(label: str, tensors: list[torch.Tensor]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise refuse(label, f"its tensors mix dtypes {sorted(str(d) for d in dtypes)}; the kernel reads them as one")


# -- embedding_renorm_ (nn.Embedding(max_norm=...)) ------------------------------------------------------
def check_embedding_renorm(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``embedding_renorm_(self, indices, max_norm, norm_type)``: scales the rows ``indices`` names. The CPU
    kernel selects them with bounds checks; CUDA's kernel writes them unchecked. The weight must be 2-d and
    every index a row of it, [0, rows): what the embedding lookup itself accepts."""
    given = given_args(("self", "indices", "max_norm", "norm_type"), args, kwargs)
    weight, indices = given.get("self"), given.get("indices")
    if not isinstance(weight, torch.Tensor) or not isinstance(indices, torch.Tensor):
        return
    if weight.dim() != 2:
        raise refuse(label, f"the weight must be 2-d (rows, width), got shape {_shape(weight)}")
    if indices.dtype not in _INDEX:
        raise refuse(label, f"indices must be int32 or int64, got {indices.dtype}")
    rows = weight.size(0)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= rows):
        raise refuse(label, f"indices hold values outside [0, {rows}), the weight's rows")


# -- _cholesky_solve_helper (torch.cholesky_solve) ---------------------------------------------------------
def check_cholesky_solve_helper(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_cholesky_solve_helper(self, A, upper)``: what ``cholesky_solve`` sends after broadcasting. The CPU
    kernel hands LAPACK one matrix of each per batch, counting batches by ``self`` and reading ``A`` as
    ``self``'s dtype (mismatched batches corrupted the heap: issue 11). So: ``A`` square (..., n, n),
    ``self`` (..., n, k) with the same batch dims, one floating or complex dtype."""
    given = given_args(("self", "A", "upper"), args, kwargs)
    b, a = given.get("self"), given.get("A")
    if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
        return
    if a.dim() < 2 or b.dim() != a.dim() or a.size(-1) != a.size(-2) or b.shape[:-2] != a.shape[:-2] \
            or b.size(-2) != a.size(-1):
        raise refuse(label, f"self {_shape(b)} and A {_shape(a)} must be (..., n, k) and (..., n, n) with the "
                     "same batch dims (torch.cholesky_solve broadcasts them before it sends this)")
    if a.dtype != b.dtype or not (a.is_floating_point() or a.is_complex()):
        raise refuse(label, f"self and A must share one floating or complex dtype, got {b.dtype} and {a.dtype}")


# -- rrelu_with_noise (F.rrelu in training) ---------------------------------------------------------------
_RRELU_ARGS = schema_args("rrelu_with_noise")


def check_rrelu_with_noise(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``rrelu_with_noise(self, noise, lower, upper, training, generator)``: in training the CPU kernel writes
    ``noise`` as a flat array of ``self.numel()`` elements; an expanded (stride 0) noise of the right shape
    corrupted the heap (``free(): invalid next size``). Its own checks cover shape and dtype; here ``noise``
    must be contiguous in training (``F.rrelu`` always gives a fresh one)."""
    given = given_args(_RRELU_ARGS, args, kwargs)
    noise = given.get("noise")
    if given.get("training") and isinstance(noise, torch.Tensor) and not noise.is_contiguous():
        raise refuse(label, f"noise (strides {list(noise.stride())} for shape {_shape(noise)}) must be contiguous "
                     "in training: the kernel writes it as a flat array")
    # The .out form: the CPU kernel writes ``out`` as a flat array of self.numel() elements and resizes it only
    # afterwards, so an empty or smaller out was written past its end (SIGSEGV on plain CPU too; found by the
    # 15-minute fuzz run of issue 29's ops). The client never sends it; keep it to what cannot go wrong.
    out, x = kwargs.get("out"), given.get("self")
    if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and (
            _shape(out) != _shape(x) or out.dtype != x.dtype or not out.is_contiguous()):
        raise refuse(label, f"out (shape {_shape(out)}, {out.dtype}, strides {list(out.stride())}) must have "
                     f"self's shape {_shape(x)} and dtype {x.dtype} and be contiguous: the kernel writes it as a "
                     "flat array before resizing it")


# -- fractional max pooling backward (nn.FractionalMaxPool2d/3d) ---------------------------------------------
def check_fractional_pool_backward(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``fractional_max_pool{2,3}d_backward(grad_output, self, kernel_size, output_size, indices)``: the kernel
    adds each gradient at the flat position in its input plane that ``indices`` names. ``grad_output`` and
    ``indices`` (int64) must have the input's leading dims and ``output_size`` last, and every index must lie
    in its plane, [0, plane)."""
    spatial = 3 if "3d" in label else 2
    given = given_args(("grad_output", "self", "kernel_size", "output_size", "indices"), args, kwargs)
    grad, x, indices, output_size = given.get("grad_output"), given.get("self"), given.get("indices"), \
        given.get("output_size")
    if not all(isinstance(t, torch.Tensor) for t in (grad, x, indices)) or not isinstance(output_size, (list, tuple)):
        return
    assert isinstance(grad, torch.Tensor) and isinstance(x, torch.Tensor) and isinstance(indices, torch.Tensor)
    if x.dim() not in (spatial + 1, spatial + 2):
        raise refuse(label, f"the input must be {spatial + 1}-d or {spatial + 2}-d, got shape {_shape(x)}")
    expect = [*x.shape[:-spatial], *output_size]
    if _shape(grad) != expect:
        raise refuse(label, f"grad_output of shape {_shape(grad)}, pooling {_shape(x)} to {list(output_size)} "
                     f"makes {expect}")
    if indices.dtype != torch.int64 or indices.shape != grad.shape:
        raise refuse(label, f"indices must be int64 of grad_output's shape {expect}, got {indices.dtype} "
                     f"{_shape(indices)}")
    plane = math.prod(x.shape[-spatial:])
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= plane):
        raise refuse(label, f"indices hold values outside [0, {plane}), the input plane")


def check_fractional_pool_backward_lists(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """The same ops before their meta run (a pre-check): ``kernel_size`` and ``output_size`` must hold one int
    per pooled dim, as their schemas say (``int[2]``/``int[3]``, which the dispatcher does not enforce); the
    meta kernel read past an empty ``output_size`` and the process died (SIGSEGV, found by the fuzzer)."""
    spatial = 3 if "3d" in label else 2
    given = given_args(("grad_output", "self", "kernel_size", "output_size", "indices"), args, kwargs)
    for name in ("kernel_size", "output_size"):
        value = given.get(name)
        if not isinstance(value, (list, tuple)) or len(value) != spatial \
                or not all(isinstance(v, int) and v > 0 for v in value):
            raise refuse(label, f"{name} must be {spatial} positive ints, got {value!r}")
    for name in ("grad_output", "self", "indices"):
        t = given.get(name)
        if isinstance(t, torch.Tensor) and t.dim() not in (spatial + 1, spatial + 2):
            raise refuse(label, f"{name} must be {spatial + 1}-d or {spatial + 2}-d, got shape {_shape(t)}")


# -- nonzero_static --------------------------------------------------------------------------------------
def check_nonzero_static(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``nonzero_static(self, size, fill_value)``: its output has ``size`` rows whatever the data; a 0-d input
    makes rows of no elements, which no byte count bounds. ``size`` must lie in [0, 2**31 - 1]."""
    size = given_args(("self",), args, kwargs).get("size")
    if isinstance(size, int) and not 0 <= size <= MAX_NONZERO_STATIC_SIZE:
        raise refuse(label, f"size {size} is outside [0, {MAX_NONZERO_STATIC_SIZE}]")


# -- random_ (torch.randint, randint_like, Tensor.random_) ------------------------------------------------
def check_random_bounds(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``random_.from(self, from, to)`` / ``random_.to(self, to)``: draws in [from, to) (``to`` None: up to
    the dtype's largest value). The range must not be empty, as torch's own check says; both ends are the
    kernel's checks against the dtype."""
    if label.startswith("aten::random_.from"):
        given = given_args(("self", "from", "to"), args, kwargs)
        low, high = given.get("from"), given.get("to")
    elif label.startswith("aten::random_.to"):
        given = given_args(("self", "to"), args, kwargs)
        low, high = 0, given.get("to")
    else:
        return
    if isinstance(low, int) and isinstance(high, int) and high <= low:
        raise refuse(label, f"random_ draws from [from, to): from {low} must be less than to {high}")
    x = given.get("self")
    if high is None and isinstance(low, int) and isinstance(x, torch.Tensor) and x.is_floating_point():
        # to None on a floating tensor: up to 2**digits, which torch checks after a loop that never ended for
        # from = 2**63 - 1 (its from + 1 overflows; found by the fuzzer)
        top = 1 << _MANTISSA_DIGITS.get(x.dtype, 53)
        if low > top:
            raise refuse(label, f"from {low} is above {top}, the largest integer a {x.dtype} tensor holds exactly")


#: Binary digits of each floating dtype's significand (std::numeric_limits<T>::digits, torch's bound).
_MANTISSA_DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


# -- GradScaler (torch.amp) --------------------------------------------------------------------------------
def _one_element(label: str, name: str, t: Any, dtype: torch.dtype) -> None:
    if isinstance(t, torch.Tensor) and (t.numel() != 1 or t.dtype != dtype):
        raise refuse(label, f"{name} must be a one-element {dtype} tensor, got {t.dtype} {_shape(t)}")


def check_amp_unscale(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: every gradient on one
    device; ``found_inf`` and ``inv_scale`` one float32 element each (the kernel reads and writes one)."""
    given = given_args(("self", "found_inf", "inv_scale"), args, kwargs)
    grads = given.get("self")
    if isinstance(grads, list) and grads and all(isinstance(g, torch.Tensor) for g in grads):
        devices = {g.device for g in grads}
        if len(devices) > 1:
            raise refuse(label, f"gradients on {len(devices)} devices: it runs on one")
    _one_element(label, "found_inf", given.get("found_inf"), torch.float32)
    _one_element(label, "inv_scale", given.get("inv_scale"), torch.float32)


def check_amp_update_scale(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``_amp_update_scale_(self, growth_tracker, found_inf, growth, backoff, interval)``: the scale and
    ``found_inf`` one float32 element each, ``growth_tracker`` one int32 element."""
    given = given_args(("self", "growth_tracker", "found_inf"), args, kwargs)
    _one_element(label, "the scale", given.get("self"), torch.float32)
    _one_element(label, "growth_tracker", given.get("growth_tracker"), torch.int32)
    _one_element(label, "found_inf", given.get("found_inf"), torch.float32)


# -- round(x, decimals=n) -------------------------------------------------------------------------------
#: Most decimals ``round.decimals`` may be asked for, either way. Past about 330 every float rounds to itself
#: or NaN (10**n is infinite or zero in float64); 10**n as an exact Python integer, which torch's reference
#: (the pre-flight's meta run of ``round.decimals_out``) computes, took minutes for n = 2**62.
MAX_ROUND_DECIMALS = 4096


def check_round_decimals(label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """``round.decimals`` / ``round_.decimals`` / ``round.decimals_out``: ``decimals`` within
    :data:`MAX_ROUND_DECIMALS` (a pre-check: the meta run itself would take minutes)."""
    decimals = kwargs.get("decimals", args[1] if len(args) > 1 else None)  # keyword-only; positional is refused later
    if isinstance(decimals, int) and abs(decimals) > MAX_ROUND_DECIMALS:
        raise refuse(label, f"decimals {decimals} is outside [-{MAX_ROUND_DECIMALS}, {MAX_ROUND_DECIMALS}] (past "
                     "about 330 a float rounds to itself or NaN)")


#: Checks that run before the pre-flight's meta run, for :data:`genie.server.validators.PRE_CHECKS`.
PRE_CHECKS = {
    "aten::round": check_round_decimals,
    "aten::round_": check_round_decimals,
    "aten::fractional_max_pool2d_backward": check_fractional_pool_backward_lists,
    "aten::fractional_max_pool3d_backward": check_fractional_pool_backward_lists,
}


#: The checks of this module by op packet name, for :mod:`genie.server.validators`.
BY_PACKET = {
    "aten::_thnn_fused_lstm_cell": check_rnn_cell,
    "aten::_thnn_fused_gru_cell": check_rnn_cell,
    "aten::_thnn_fused_lstm_cell_backward_impl": check_rnn_cell_backward,
    "aten::_thnn_fused_gru_cell_backward": check_rnn_cell_backward,
    "aten::embedding_renorm_": check_embedding_renorm,
    "aten::_cholesky_solve_helper": check_cholesky_solve_helper,
    "aten::rrelu_with_noise": check_rrelu_with_noise,
    "aten::rrelu_with_noise_": check_rrelu_with_noise,
    "aten::fractional_max_pool2d_backward": check_fractional_pool_backward,
    "aten::fractional_max_pool3d_backward": check_fractional_pool_backward,
    "aten::nonzero_static": check_nonzero_static,
    "aten::random_": check_random_bounds,
    "aten::_amp_foreach_non_finite_check_and_unscale_": check_amp_unscale,
    "aten::_amp_update_scale_": check_amp_update_scale,
}
