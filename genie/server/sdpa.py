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
the forward returns the first rows, the backward pads them again), 0-dim int64 seed and offset
(dropout is never sent this way: the client keeps the math path for dropout).

Hardware-only: exercised by ``scripts/gpu-check`` (tests/device/test_sdpa.py on a CUDA server). On a
CPU server nothing here runs (the client sends the CPU flash kernel's own op instead).
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


def _backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_bias: torch.Tensor | None, grad_input_mask: list[bool], out: torch.Tensor, logsumexp: torch.Tensor,
              cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
              philox_seed: torch.Tensor, philox_offset: torch.Tensor, *, scale: float | None = None) -> tuple[Any, ...]:
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
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                 attn_mask=attn_bias, scale=scale)
    seed = torch.zeros((), dtype=torch.long, device=query.device)
    return out, lse, None, None, query.size(-2), key.size(-2), seed, seed.clone(), None


def _cpu_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_bias: torch.Tensor | None, grad_input_mask: list[bool], out: torch.Tensor,
                  logsumexp: torch.Tensor, cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float,
                  is_causal: bool, philox_seed: torch.Tensor, philox_offset: torch.Tensor, *,
                  scale: float | None = None) -> tuple[Any, ...]:
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
