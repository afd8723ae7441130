"""Fused kernels reach the server whole: F.scaled_dot_product_attention sends the fused attention op the server's
kind runs (on a CPU server the flash CPU kernel a local CPU run uses, not the math path's dozen ops) and
AdamW(fused=True) sends _fused_adamw_; the choice for a CUDA server is checked here on its own, its kernels
on a CUDA server (hardware-only: scripts/gpu-check)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from genie import _C
from genie.device import registry
from genie.testing import shared_server_devices

D0 = "remote_accelerator:0"
CUDA = "cuda" in shared_server_devices()
#: A CUDA server's fused attention is opt-in (genie/device/registry.py, _sdp_kind).
CUDA_FUSED = CUDA and os.environ.get("GENIE_SDPA_CUDA_FUSED") == "1"
FLASH, MATH, OVERRIDEABLE = 1, 0, 4  # at::SDPBackend

pytestmark = [pytest.mark.usefixtures("remote")]


class _Ops(TorchDispatchMode):
    """The aten ops a computation dispatches below autograd (what reaches the device), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _attention_ops(device: str, fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...],
                   dtype: torch.dtype = torch.float32, grad: str = "sum") -> tuple[set[str], list[torch.Tensor]]:
    """What ``fn`` dispatched (attention, softmax, bmm ops) and its output and inputs' gradients. ``grad``: the
    backward of ``out.sum()`` (an expanded gradient: stride 0) or of a random contiguous gradient."""
    gen = torch.Generator().manual_seed(0)
    # query, key and value take gradients; a mask does not (with one, a local CPU run takes the math path too)
    tensors = [torch.randn(s, generator=gen, dtype=dtype).to(device).requires_grad_(i < 3) for i, s in enumerate(shapes)]
    with _Ops() as ops:
        out = fn(*tensors)
        if grad == "sum":
            out.sum().backward()
        else:
            out.backward(torch.randn(out.shape, generator=gen, dtype=dtype).to(device))
    fused = {n for n in ops.names if "attention" in n or "softmax" in n or n.startswith("aten.bmm")}
    return fused, [out.detach().cpu(), *(t.grad.cpu() for t in tensors if t.grad is not None)]


CASES: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[int, ...]]]] = {
    "plain": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [(2, 4, 8, 16)] * 3),
    "causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [(2, 4, 8, 16)] * 3),
    "float_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                   [(2, 4, 8, 16)] * 3 + [(8, 8)]),
    "3d": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [(4, 8, 16)] * 3),
}


@pytest.mark.cpu_server
@pytest.mark.parametrize("case", list(CASES))
def test_attention_sends_what_a_local_cpu_run_runs(case: str) -> None:
    fn, shapes = CASES[case]
    remote_ops, remote = _attention_ops(D0, fn, *shapes)
    local_ops, local = _attention_ops("cpu", fn, *shapes)
    assert remote_ops == local_ops
    if case != "3d":  # a local CPU run keeps the math path for 3-dim inputs, and so does the device
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in remote_ops
        assert not any("softmax" in n for n in remote_ops)  # not the math path
    for r, c in zip(remote, local, strict=True):
        torch.testing.assert_close(r, c)


def test_transformer_layer_uses_the_fused_kernel() -> None:
    if CUDA and not CUDA_FUSED:
        pytest.skip("a CUDA server's fused attention is opt-in (GENIE_SDPA_CUDA_FUSED=1)")
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).to(D0)
    x = torch.randn(2, 8, 16, device=D0)
    with _Ops() as ops:
        layer(x).sum().backward()
    kernel = "overrideable" if CUDA else "flash_attention_for_cpu"
    assert any(kernel in n for n in ops.names), sorted(set(ops.names))
    assert not any(n.startswith("aten._softmax") for n in ops.names)


def test_choice_for_a_cuda_server_is_overrideable_where_flash_or_efficient_serve() -> None:
    q = torch.empty(2, 4, 8, 64, device=D0, dtype=torch.float16)
    kinds = [d.kind for d in registry.table().devices]
    try:
        _C.set_sdp_kinds(["cuda"] * len(kinds))
        assert _C.sdp_choice(q, q, q, None, 0.0, False, False) == OVERRIDEABLE
        assert _C.sdp_choice(q.float(), q.float(), q.float(), None, 0.0, True, False) == OVERRIDEABLE
        assert _C.sdp_choice(q, q, q, None, 0.1, False, False) == MATH  # dropout: its random state stays local
        odd = torch.empty(2, 4, 8, 20, device=D0, dtype=torch.float16)
        assert _C.sdp_choice(odd, odd, odd, None, 0.0, False, False) == MATH  # head dim not a multiple of 8
        three = torch.empty(4, 8, 64, device=D0, dtype=torch.float16)
        assert _C.sdp_choice(three, three, three, None, 0.0, False, False) == MATH
        _C.set_sdp_kinds(["mps"] * len(kinds))
        assert _C.sdp_choice(q, q, q, None, 0.0, False, False) == MATH  # a kind with no rule: the math path
    finally:
        _C.set_sdp_kinds(kinds)


@pytest.mark.cpu_server
def test_choice_for_a_cpu_server_is_the_local_cpu_choice() -> None:
    for shape, dtype in [((2, 4, 8, 16), torch.float32), ((2, 4, 8, 16), torch.bfloat16), ((1, 1, 3, 5), torch.float64)]:
        local = torch.empty(shape, dtype=dtype)
        remote = torch.empty(shape, dtype=dtype, device=D0)
        assert _C.sdp_choice(remote, remote, remote, None, 0.0, False, False) == \
            torch._fused_sdp_choice(local, local, local)


@pytest.mark.cpu_server
@pytest.mark.parametrize("case", ["plain", "causal", "float_mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_cuda_servers_fused_op_is_sent_whole_and_runs_on_a_cpu_server(case: str, dtype: torch.dtype) -> None:
    """The client's side of a CUDA server's fused attention, end to end on the CPU server: the choice for a CUDA
    kind sends ATen's overrideable op and its backward whole (one op each; on the first GPU check the client could
    not dispatch them), undefined outputs (cum_seq_q, a masked-off bias gradient) travel as nils, and the
    server's CPU kernels of those ops (the CPU flash kernel, genie/server/sdpa.py) give a local CPU run's values.
    The CUDA kernels behind the same ops run in scripts/gpu-check."""
    fn, shapes = CASES[case]
    kinds = [d.kind for d in registry.table().devices]
    try:
        _C.set_sdp_kinds(["cuda"] * len(kinds))
        remote_ops, remote = _attention_ops(D0, fn, *(s[:-1] + (64,) if len(s) == 4 else s for s in shapes),
                                            dtype=dtype)
    finally:
        _C.set_sdp_kinds(kinds)
    _, local = _attention_ops("cpu", fn, *(s[:-1] + (64,) if len(s) == 4 else s for s in shapes), dtype=dtype)
    assert "aten._scaled_dot_product_fused_attention_overrideable.default" in remote_ops
    assert "aten._scaled_dot_product_fused_attention_overrideable_backward.default" in remote_ops
    assert not any("softmax" in n for n in remote_ops)
    rtol, atol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-5)
    for r, c in zip(remote, local, strict=True):
        torch.testing.assert_close(r, c, rtol=rtol, atol=atol)


def test_fused_adamw_is_sent_whole_and_matches_cpu() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    remote = torch.nn.Linear(8, 4).to(D0)
    remote.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, remote)]
    x = torch.randn(16, 8)
    for _ in range(3):
        for m, opt, inp in ((model, opts[0], x), (remote, opts[1], x.to(D0))):
            opt.zero_grad()
            m(inp).pow(2).mean().backward()
            with _Ops() as ops:
                opt.step()
            assert "aten._fused_adamw_.default" in ops.names
            assert not any(n.startswith(("aten._foreach_lerp", "aten.lerp")) for n in ops.names)  # not unfused
    rtol, atol = (1e-4, 1e-5) if CUDA else (0.0, 0.0)
    for p, q in zip(model.parameters(), remote.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=rtol, atol=atol)


@pytest.mark.hardware
@pytest.mark.skipif(not CUDA_FUSED, reason="needs the shared server on a CUDA device (scripts/gpu-check) and "
                    "GENIE_SDPA_CUDA_FUSED=1")
@pytest.mark.parametrize("grad", ["sum", "random"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["flash", "efficient"])
def test_cuda_server_runs_attention_on_fused_kernels(dtype: torch.dtype, grad: str) -> None:
    """The flash kernel's float16 results did not match on the last GPU run (largest difference 5.25): every
    mismatching tensor is named with its largest difference, for an expanded gradient and a dense one, so a run
    tells the forward from the backward and the gradient's layout from the kernel."""
    fn = CASES["causal"][0]
    shapes = [(2, 4, 64, 64)] * 3
    ops, remote = _attention_ops(D0, fn, *shapes, dtype=dtype, grad=grad)
    assert "aten._scaled_dot_product_fused_attention_overrideable.default" in ops
    assert "aten._scaled_dot_product_fused_attention_overrideable_backward.default" in ops
    # the same values (randn in float16 rounds float32's draws), computed in float32 on the CPU
    _, local = _attention_ops("cpu", fn, *shapes, dtype=torch.float32, grad=grad)
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    names = ["output", "query.grad", "key.grad", "value.grad"]
    bad = [f"{name}: largest difference {(r.float() - c).abs().max().item():.4g} (largest value "
           f"{c.abs().max().item():.4g}, strides after .cpu() {tuple(r.stride())})"
           for name, r, c in zip(names, remote, local, strict=True)
           if not torch.allclose(r.float(), c, rtol=tol, atol=tol)]
    assert not bad, "; ".join(bad)
