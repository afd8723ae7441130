"""Hardware-only (a CUDA GPU; scripts/gpu-check's ``sdpa`` step): the CUDA kernels genie registers for ATen's
overrideable SDPA ops (genie.server.sdpa) against torch's own ``F.scaled_dot_product_attention`` on the same GPU,
in this process: no client, no wire, no node.

On the second GPU check (H200, torch 2.11) the fused path's float16 results, through a node, differed from a CPU
reference by up to 5.25 while the memory-efficient kernel's float32 ones matched. The same client path passes on a
CPU node with float16 (tests/device/test_sdpa.py). This file tells the kernels themselves from the data path around
them. It runs each as a node does: ``out`` and ``logsumexp`` laid out as the client described them (contiguous, as
the node's output rule stores them), and the gradient either dense or the stride-0 expansion of ``out.sum()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from genie.server import sdpa

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware-only: needs a CUDA GPU")
CUDA = "cuda:0"


def _inputs(dtype: torch.dtype, grad: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 64, generator=gen, dtype=dtype).to(CUDA) for _ in range(3))
    g = (torch.ones((), dtype=dtype, device=CUDA).expand(2, 4, 64, 64) if grad == "sum"
         else torch.randn(2, 4, 64, 64, generator=gen, dtype=dtype).to(CUDA))
    return [q, k, v], g


@pytest.mark.hardware
@pytest.mark.parametrize("grad", ["sum", "random"])
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_registered_kernels_equal_torchs_own_attention_on_the_gpu(dtype: torch.dtype, causal: bool, grad: str) -> None:
    """Output and the three gradients of genie's flash (16-bit) or memory-efficient (float32) kernel call, against
    torch's own choice on CUDA for the same tensors (the same kernels: they should agree to the last bits or so)."""
    (q, k, v), g = _inputs(dtype, grad)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], is_causal=causal)
    want.backward(g)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = sdpa._forward(q, k, v, None, 0.0, causal)
    # as a node holds them: each output in the layout the client described (contiguous)
    out_stored, lse_stored = out.contiguous(), lse.contiguous()
    grads = sdpa._backward(g, q, k, v, None, [True, True, True, False], out_stored, lse_stored, cum_q, cum_k,
                           max_q, max_k, 0.0, causal, seed, offset)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    got: list[Any] = [out, *grads[:3]]
    expected: list[Any] = [want.detach(), *(t.grad for t in leaves)]
    names = ["output", "query.grad", "key.grad", "value.grad"]
    bad = [f"{name}: largest difference {(a.float() - b.float()).abs().max().item():.4g} (largest value "
           f"{b.float().abs().max().item():.4g}; strides {tuple(a.stride())})"
           for name, a, b in zip(names, got, expected, strict=True)
           if a is None or not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)]
    assert not bad, f"{sdpa.kernel_for(q, None)} kernel: " + "; ".join(bad)
