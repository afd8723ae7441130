"""Fused attention on a CUDA server: the overrideable SDPA ops run on flash or memory-efficient kernels.

A client's ``F.scaled_dot_product_attention`` on a device served by CUDA sends ATen's
``_scaled_dot_product_fused_attention_overrideable`` (and, in backward, its ``_backward``): genie._C
answers ATen's kernel choice with ``overrideable`` for calls those kernels serve
(``genie/csrc/device/sdpa.cpp``). Those ops have no CUDA kernel of torch's own; this module registers one
that runs what a local CUDA run would: flash attention for float16/bfloat16 without a mask,
memory-efficient attention otherwise (float32, or an attention bias). The choice is a function of
dtypes and the bias alone, so forward and backward always agree.

Output shapes follow the overrideable op's meta kernel, which the client used: a logsumexp of
(batch, heads, query length) in float32 (memory-efficient attention pads it to a multiple of 32:
the forward returns the first rows, the backward pads them again), 0-dim int64 seed and offset.

Dropout: the client's own choice keeps the math path when ``dropout_p > 0`` (its ``native_dropout`` draws
from the session's generator), but a client may send the overrideable op with dropout itself. That call
never reaches a kernel here that would draw from the process's generator: :mod:`genie.server.rng` runs it
by :func:`attention_with_dropout`, on any device, with the session's generator. It draws one seed from that
generator, returns it as ``philox_seed``, and draws the keep mask from a generator seeded with it, so the
backward (:func:`_dropout_backward`) rebuilds the same mask from the forward's output and draws nothing.
The registered kernels refuse ``dropout_p > 0`` (reached only outside a session).

The CUDA kernels are hardware-only: exercised by ``scripts/gpu-check`` (tests/device/test_sdpa.py on a CUDA
server). A CPU server's client sends the CPU flash kernel's own op, but the CPU kernels and the dropout path
run there when a client sends the overrideable op (tests/device/test_attention_dropout.py).
"""

from __future__ import annotations

from typing import Any

import torch

_aten = torch.ops.aten
#: memory-efficient attention's logsumexp rows come in blocks of this many
_LSE_BLOCK = 32
_library: list[Any] = []


def kernel_for(query: torch.Tensor, attn_bias: torch.Tensor | None) -> str:
    """``"flash"`` or ``"efficient"``: the CUDA kernel an overrideable SDPA call runs on."""
    if attn_bias is None and query.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    return "efficient"


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False, *,
             scale: float | None = None) -> tuple[Any, ...]:
    _refuse_dropout(dropout_p)
    seed = torch.zeros((), dtype=torch.long, device=query.device)
    offset = torch.zeros((), dtype=torch.long, device=query.device)
    length = query.size(-2)
    if kernel_for(query, attn_bias) == "flash":
        out, lse, _, _, max_q, max_k, _, _, _ = _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)
        return out, lse, None, None, max_q, max_k, seed, offset, None
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(query, key, value, attn_bias, True, dropout_p,
                                                                   is_causal, scale=scale)
    return out, lse[..., :length], None, None, length, key.size(-2), seed, offset, None


def _math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: torch.Tensor | None,
          dropout_p: float, is_causal: bool, scale: float | None, seed: int) -> tuple[Any, ...]:
    """Attention's math path (ATen's ``_scaled_dot_product_attention_math``: softmax, then a Bernoulli(1 - p)
    keep mask scaled by 1 / (1 - p)), its mask drawn from a generator seeded with ``seed``, in float32 at least
    (as the fused kernels): (output in query's dtype, logsumexp, softmax weights, weights after dropout, mask
    scaled, q, k, v in the compute dtype, the scale)."""
    compute = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    factor = scale if scale is not None else query.size(-1) ** -0.5
    scores = (q @ k.transpose(-2, -1)) * factor
    if is_causal:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_bias is not None:
        scores = (scores.masked_fill(~attn_bias, float("-inf")) if attn_bias.dtype == torch.bool
                  else scores + attn_bias.to(compute))
    logsumexp = torch.logsumexp(scores, -1)
    weights = torch.softmax(scores, -1)
    masks = torch.Generator(device=weights.device)
    masks.manual_seed(seed)
    keep = 1.0 - dropout_p
    kept = torch.empty_like(weights, dtype=torch.bool).bernoulli_(keep, generator=masks)
    scaled_mask = kept * (0.0 if keep == 0 else 1.0 / keep)
    dropped = weights * scaled_mask
    return (dropped @ v).to(query.dtype), logsumexp.float(), weights, dropped, scaled_mask, q, k, v, factor


def attention_with_dropout(generator: torch.Generator, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attn_bias: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                           return_debug_mask: bool = False, *, scale: float | None = None) -> tuple[Any, ...]:
    """The overrideable SDPA op's forward with ``dropout_p > 0`` drawing from ``generator`` (one seed: the
    keep mask's generator's, returned as ``philox_seed`` for the backward)."""
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    out, logsumexp = _math(query, key, value, attn_bias, dropout_p, is_causal, scale, seed)[:2]
    philox_seed = torch.tensor(seed, dtype=torch.long, device=query.device)
    philox_offset = torch.zeros((), dtype=torch.long, device=query.device)
    return out, logsumexp, None, None, query.size(-2), key.size(-2), philox_seed, philox_offset, None


def _refuse_dropout(dropout_p: float) -> None:
    if dropout_p != 0.0:
        raise RuntimeError("_scaled_dot_product_fused_attention_overrideable with dropout_p > 0 runs only in a "
                           "session, drawing from its generator (genie.server.rng); call attention_with_dropout "
                           "with a generator instead")


def _dropout_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_bias: torch.Tensor | None, grad_input_mask: list[bool], dropout_p: float, is_causal: bool,
                      philox_seed: torch.Tensor, scale: float | None) -> tuple[Any, ...]:
    """The backward of :func:`attention_with_dropout`: the forward again with the mask of ``philox_seed``,
    differentiated by hand (a kernel runs below autograd); draws nothing."""
    if philox_seed.numel() != 1 or philox_seed.dtype != torch.long:
        raise ValueError(f"philox_seed must be the forward's one int64 seed, got {philox_seed.dtype} of "
                         f"{philox_seed.numel()} elements; pass the forward's philox_seed output")
    _, _, weights, dropped, scaled_mask, q, k, v, factor = _math(query, key, value, attn_bias, dropout_p, is_causal,
                                                                 scale, int(philox_seed.item()))
    g = grad_out.to(v.dtype)
    grad_v = dropped.transpose(-2, -1) @ g
    grad_weights = (g @ v.transpose(-2, -1)) * scaled_mask
    grad_scores = weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True))
    grad_q = (grad_scores @ k) * factor
    grad_k = (grad_scores.transpose(-2, -1) @ q) * factor
    grad_bias = None
    if attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3] and attn_bias.is_floating_point():
        extra = grad_scores.dim() - attn_bias.dim()  # the bias broadcasts over leading and size-1 dimensions
        summed = grad_scores.sum(dim=tuple(range(extra))) if extra else grad_scores
        dims = tuple(i for i, n in enumerate(attn_bias.shape) if n == 1 and summed.size(i) != 1)
        grad_bias = (summed.sum(dim=dims, keepdim=True) if dims else summed).to(attn_bias.dtype)
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), grad_bias


def _backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_bias: torch.Tensor | None, grad_input_mask: list[bool], out: torch.Tensor, logsumexp: torch.Tensor,
              cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
              philox_seed: torch.Tensor, philox_offset: torch.Tensor, *, scale: float | None = None) -> tuple[Any, ...]:
    if dropout_p != 0.0:
        return _dropout_backward(grad_out, query, key, value, attn_bias, grad_input_mask, dropout_p, is_causal,
                                 philox_seed, scale)
    if kernel_for(query, attn_bias) == "flash":
        gq, gk, gv = _aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            philox_seed, philox_offset, scale=scale)
        return gq, gk, gv, None
    length = logsumexp.size(-1)
    padded = -(-length // _LSE_BLOCK) * _LSE_BLOCK
    lse = torch.nn.functional.pad(logsumexp, (0, padded - length)) if padded != length else logsumexp
    gq, gk, gv, gb = _aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
        [*grad_input_mask[:3], bool(grad_input_mask[3]) and attn_bias is not None], is_causal, scale=scale)
    return gq, gk, gv, gb


def _cpu_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False, *,
                 scale: float | None = None) -> tuple[Any, ...]:
    _refuse_dropout(dropout_p)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                 attn_mask=attn_bias, scale=scale)
    seed = torch.zeros((), dtype=torch.long, device=query.device)
    return out, lse, None, None, query.size(-2), key.size(-2), seed, seed.clone(), None


def _cpu_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_bias: torch.Tensor | None, grad_input_mask: list[bool], out: torch.Tensor,
                  logsumexp: torch.Tensor, cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float,
                  is_causal: bool, philox_seed: torch.Tensor, philox_offset: torch.Tensor, *,
                  scale: float | None = None) -> tuple[Any, ...]:
    if dropout_p != 0.0:
        return _dropout_backward(grad_out, query, key, value, attn_bias, grad_input_mask, dropout_p, is_causal,
                                 philox_seed, scale)
    if attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3]:
        raise NotImplementedError("the gradient of an attention bias is computed on CUDA servers only (the CPU "
                                  "flash kernel has none); detach the bias, or serve on a GPU")
    gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
    return gq, gk, gv, None


def install() -> None:
    """Register the overrideable SDPA ops' kernels (idempotent): CUDA's run flash or memory-efficient attention;
    the CPU's run the CPU flash kernel, so a client that chose the fused path (the choice a CUDA server gets)
    runs whole on a CPU server too: CI covers the client's side of that path there."""
    if _library:
        return
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    lib.impl("_scaled_dot_product_fused_attention_overrideable", _forward, "CUDA")
    lib.impl("_scaled_dot_product_fused_attention_overrideable_backward", _backward, "CUDA")
    lib.impl("_scaled_dot_product_fused_attention_overrideable", _cpu_forward, "CPU")
    lib.impl("_scaled_dot_product_fused_attention_overrideable_backward", _cpu_backward, "CPU")
    _library.append(lib)
