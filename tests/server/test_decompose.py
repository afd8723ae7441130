"""Ops without a kernel for the server's device run their registered decomposition; meta and server agree."""

from __future__ import annotations

import pytest
import torch

from tests.raw_client import RawClient, T, desc, op


@pytest.fixture
def client(genie_serve):
    with RawClient(genie_serve.port) as c:
        c.handshake()
        yield c


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def test_cuda_only_op_runs_its_decomposition_on_a_cpu_server(client):
    """aten::cudnn_batch_norm has no CPU kernel; the server runs torch._decomp's decomposition instead."""
    name = "aten::cudnn_batch_norm"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")  # the premise of this test
    x = torch.randn(4, 3, 5)
    weight, bias = torch.rand(3) + 0.5, torch.randn(3)
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    args = (x, weight, bias, running_mean, running_var, True, 0.1, 1e-5)
    metas = torch.ops.aten.cudnn_batch_norm.default(*[_meta(a) if isinstance(a, torch.Tensor) else a for a in args])
    outs = [desc(10 + i, m) if m.numel() else desc(0, m) for i, m in enumerate(metas)]
    tensors = [T(i + 1, a) for i, a in enumerate(args[:5])]
    client.send_batch([op(name, [*tensors, True, 0.1, 1e-5], {}, outs)],
                      uploads=[(i + 1, 0, a) for i, a in enumerate(args[:5])])
    assert client.sync().deferred == []
    expected_mean, expected_var = torch.zeros(3), torch.ones(3)
    expected = torch.nn.functional.batch_norm(x, expected_mean, expected_var, weight, bias, True, 0.1, 1e-5)
    torch.testing.assert_close(client.fetch(10, metas[0]), expected)
    # the decomposition updated the running statistics in place, in the client's storages
    torch.testing.assert_close(client.fetch(4, running_mean), expected_mean)
    torch.testing.assert_close(client.fetch(5, running_var), expected_var)


def test_op_with_neither_kernel_nor_decomposition_is_a_clear_execution_error(client):
    a = torch.ones(2, 2, dtype=torch.float16)
    client.send_batch([op("aten::mm.dtype", [T(1, a), T(1, a), torch.float32], {},
                          [desc(2, torch.empty(2, 2))])], uploads=[(1, 0, a)])
    [err] = client.sync().deferred
    assert err["kind"] == "execution" and "aten::mm.dtype" in err["message"] and err["storages"] == [2]
