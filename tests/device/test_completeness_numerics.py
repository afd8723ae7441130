"""Results the OpInfo gate found differing from a CPU run, each pinned against the shared test server.

- ``native_layer_norm``, ``native_group_norm`` and ``addr`` run whole on the server: their
  CompositeExplicitAutograd kernels (``math_*``) had run on the client for PrivateUse1, as several ops that
  round each intermediate to float16/bfloat16, where the CPU (and CUDA) kernel accumulates in float32.
- Their saved statistics, and ``_native_batch_norm_legit.no_stats``', come back in the dtype the CPU kernel
  gives them (the input's for half precision without a float32 parameter).
- A CPU tensor changed in place right after ``.to(device)`` leaves the device copy as it was.
- ``repeat_interleave`` without ``output_size`` runs (the client sums ``repeats`` first, as CUDA does); the
  server checks the counts it is sent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genie.errors import RemoteExecutionError

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")

HALF = [torch.float16, torch.bfloat16]


def _same(device_result: torch.Tensor, cpu_result: torch.Tensor, exact: bool) -> None:
    """Bit for bit on a CPU server (the same kernel on the same inputs); CUDA's tolerances elsewhere."""
    assert device_result.dtype == cpu_result.dtype
    if exact:
        torch.testing.assert_close(device_result.cpu(), cpu_result, rtol=0, atol=0)
    else:
        torch.testing.assert_close(device_result.cpu(), cpu_result, rtol=1e-2, atol=1e-2)


def _cpu_server(remote) -> bool:
    from genie.device.registry import device_at

    return device_at(0).kind == "cpu"


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_half_precision_layer_norm_and_its_statistics_equal_the_cpu_kernel(remote, dtype):
    g = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(s, generator=g).to(dtype) * 4 for s in ((3, 2, 6), (2, 6), (2, 6)))
    expected = torch.ops.aten.native_layer_norm(x, [2, 6], w, b, 0.5)
    got = torch.ops.aten.native_layer_norm(x.to(D0), [2, 6], w.to(D0), b.to(D0), 0.5)
    for e, r in zip(expected, got, strict=True):
        _same(r, e, _cpu_server(remote))
    _same(F.layer_norm(x.to(D0), [6], eps=1e-5), F.layer_norm(x, [6], eps=1e-5), _cpu_server(remote))


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_half_precision_group_norm_and_its_statistics_equal_the_cpu_kernel(remote, dtype):
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(2, 6, 5, generator=g).to(dtype), torch.randn(6, generator=g).to(dtype), \
        torch.randn(6, generator=g).to(dtype)
    expected = torch.ops.aten.native_group_norm(x, w, b, 2, 6, 5, 3, 0.5)
    got = torch.ops.aten.native_group_norm(x.to(D0), w.to(D0), b.to(D0), 2, 6, 5, 3, 0.5)
    for e, r in zip(expected, got, strict=True):
        _same(r, e, _cpu_server(remote))
    # a float32 weight makes the CPU kernel's statistics float32 ("mixed type")
    mixed = torch.ops.aten.native_group_norm(x.to(D0), w.float().to(D0), b.float().to(D0), 2, 6, 5, 3, 0.5)
    assert [t.dtype for t in mixed] == [dtype, torch.float32, torch.float32]
    assert mixed[1].cpu().dtype == torch.float32


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_half_precision_addr_equals_the_cpu_kernel(remote, dtype):
    g = torch.Generator().manual_seed(7)
    m, u, v = torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, generator=g).to(dtype), \
        torch.randn(5, generator=g).to(dtype)
    _same(torch.addr(m.to(D0), u.to(D0), v.to(D0), beta=0.2, alpha=0.6),
          torch.addr(m, u, v, beta=0.2, alpha=0.6), _cpu_server(remote))
    out = torch.empty(4, 5, dtype=dtype, device=D0)
    torch.addr(m.to(D0), u.to(D0), v.to(D0), out=out)
    _same(out, torch.addr(m, u, v), _cpu_server(remote))


def test_layer_norm_backward_still_matches_the_cpu(remote):
    g = torch.Generator().manual_seed(8)
    x, w, b = torch.randn(3, 7, generator=g), torch.randn(7, generator=g), torch.randn(7, generator=g)
    grads = []
    for device in ("cpu", D0):
        leaves = [t.detach().to(device).requires_grad_() for t in (x, w, b)]
        (F.layer_norm(leaves[0], [7], leaves[1], leaves[2]) * torch.arange(7.).to(device)).sum().backward()
        grads.append([t.grad.cpu() for t in leaves])
    for a, r in zip(*grads, strict=True):
        torch.testing.assert_close(r, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_batch_norm_without_running_statistics_keeps_the_cpu_kernels_statistics_dtype(remote, dtype):
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(9)).to(dtype)
    expected = torch.ops.aten._native_batch_norm_legit.no_stats(x, None, None, True, 0.1, 1e-5)
    got = torch.ops.aten._native_batch_norm_legit.no_stats(x.to(D0), None, None, True, 0.1, 1e-5)
    for e, r in zip(expected, got, strict=True):
        _same(r, e, _cpu_server(remote))


def test_a_cpu_tensor_changed_in_place_after_it_was_moved_leaves_the_device_copy_as_it_was(remote):
    small = torch.ones(5, dtype=torch.float16)
    moved = small.to(D0)
    small.mul_(2)
    rows = torch.ones(3, 4)
    moved_rows = rows.to(D0)
    rows[0].zero_()
    # float arithmetic runs on the server (a host shadow of the upload never answers it)
    assert (moved + 0).cpu().tolist() == [1.0] * 5
    assert (moved_rows * 1).cpu().equal(torch.ones(3, 4))
    assert moved.cpu().tolist() == [1.0] * 5


def test_embedding_bag_with_max_norm_in_half_precision_matches_the_cpu(remote):
    """The OpInfo sample that found the upload above: the CPU run renormalized its weight in place after the
    device's copy was queued, so the device renormalized rows already renormalized."""
    g = torch.Generator().manual_seed(10)
    weight = (torch.randn(5, 5, generator=g) * 8).half()
    idx = torch.tensor([[0, 1], [1, 0]])
    psw = torch.randn(2, 2, generator=g).half()
    moved = weight.to(D0)
    expected = F.embedding_bag(idx, weight, max_norm=1.0, mode="sum", per_sample_weights=psw)
    got = F.embedding_bag(idx.to(D0), moved, max_norm=1.0, mode="sum", per_sample_weights=psw.to(D0))
    _same(got, expected, _cpu_server(remote))
    _same(moved, weight, _cpu_server(remote))  # both renormalized once


def test_repeat_interleave_by_a_tensor_of_counts_matches_the_cpu(remote):
    x = torch.arange(12.).reshape(3, 4)
    counts = torch.tensor([2, 0, 3, 1])
    assert torch.repeat_interleave(x.to(D0), counts.to(D0), dim=1).cpu().equal(
        torch.repeat_interleave(x, counts, dim=1))
    assert torch.repeat_interleave(counts.to(D0)).cpu().equal(torch.repeat_interleave(counts))
    assert torch.repeat_interleave(torch.tensor([], dtype=torch.long).to(D0)).cpu().numel() == 0
    # with output_size given, nothing is read back first
    assert torch.repeat_interleave(counts.to(D0), output_size=6).cpu().equal(torch.repeat_interleave(counts))


@pytest.mark.parametrize(("counts", "size", "why"), [
    ([5, -4], 1, "counts in [0, output_size=1]"),
    ([2, 3], 4, "sum to 5, not output_size 4"),
    ([2**62] * 4, 1, "counts in [0, output_size=1]"),
], ids=["negative-count", "wrong-sum", "huge-counts"])
def test_repeat_interleave_with_counts_that_do_not_make_output_size_is_refused_and_the_session_goes_on(
        remote, counts, size, why):
    """Negative counts summing to output_size corrupted the CPU kernel's heap (``free(): invalid pointer``)."""
    out = torch.ops.aten.repeat_interleave.Tensor(torch.tensor(counts).to(D0), output_size=size)
    with pytest.raises(RemoteExecutionError, match="refused before running") as caught:
        out.cpu()
    assert why in str(caught.value)
    assert torch.ones(3, device=D0).sum().item() == 3.0
