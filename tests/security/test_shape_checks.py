"""Issue 29's newly allowed kernels on the raw wire: malformed arguments are refused before the kernel runs,
inputs a CPU kernel reads as flat arrays are served as contiguous copies (as CUDA takes them), and the server
and a bystander session survive every case (genie/server/shape_checks.py, genie/server/validators.py)."""

from __future__ import annotations

import pytest
import torch

from genie.testing import serve_subprocess
from tests.raw_client import T, desc, op, sync

_F32 = desc(1, torch.ones(1))[1]
_I64 = desc(1, torch.ones(1, dtype=torch.int64))[1]
V3 = torch.ones(3)
ONE = torch.ones(1)


@pytest.fixture(scope="module")
def server():
    with serve_subprocess("--port", "0", "--devices", "cpu", env={"GENIE_MAX_SESSION_BYTES": str(64 << 20)}) as s:
        yield s




def _upload(*tensors: torch.Tensor, first: int = 10) -> tuple[list[T], list[tuple[int, int, torch.Tensor]]]:
    return [T(first + i, t) for i, t in enumerate(tensors)], [(first + i, 0, t) for i, t in enumerate(tensors)]


_GATES, _STATE = torch.ones(2, 8), torch.ones(2, 2)
_IDX_OUT = torch.full((1, 1, 2, 2), 16, dtype=torch.int64)


@pytest.mark.parametrize(("name", "args", "kwargs", "uploads", "expect"), [
    # LSTM gates (B, 4H) for a (B, H) state: a narrower gate tensor would be read past its end on CUDA
    ("aten::_thnn_fused_lstm_cell", [T(10, torch.ones(2, 4)), T(11, _GATES), T(12, _STATE)], {},
     [(10, 0, torch.ones(2, 4)), (11, 0, _GATES), (12, 0, _STATE)], "needs gates of shape [2, 8]"),
    ("aten::_thnn_fused_gru_cell", [T(10, torch.ones(2, 6)), T(11, torch.ones(2, 6)), T(12, _STATE), T(13, V3)], {},
     [(10, 0, torch.ones(2, 6)), (11, 0, torch.ones(2, 6)), (12, 0, _STATE), (13, 0, V3)], "input_bias of shape [3]"),
    ("aten::_thnn_fused_lstm_cell_backward_impl", [T(10, _STATE), None, T(10, _STATE), T(10, _STATE), T(11, _GATES[:, :4]),
                                                   True], {},
     [(10, 0, _STATE), (11, 0, _GATES)], "workspace of shape [2, 4], the forward made [2, 8]"),
    ("aten::_thnn_fused_gru_cell_backward", [T(10, _STATE), T(11, _GATES), True], {},
     [(10, 0, _STATE), (11, 0, _GATES)], "the forward made [2, 10]"),
    # CUDA's renorm kernel writes the rows indices name unchecked
    ("aten::embedding_renorm_", [T(10, torch.ones(4, 3)), T(11, torch.tensor([0, 4])), 1.0, 2.0], {},
     [(10, 0, torch.ones(4, 3)), (11, 0, torch.tensor([0, 4]))], "outside [0, 4)"),
    # batches counted by self, A read by them: issue 11's heap corruption
    ("aten::_cholesky_solve_helper", [T(10, torch.ones(2, 3, 1)), T(11, torch.ones(1, 3, 3)), False], {},
     [(10, 0, torch.ones(2, 3, 1)), (11, 0, torch.ones(1, 3, 3))], "same batch dims"),
    ("aten::_cholesky_solve_helper", [T(10, torch.ones(3, 1)), T(11, torch.ones(3, 3, dtype=torch.float64)), False],
     {}, [(10, 0, torch.ones(3, 1)), (11, 0, torch.ones(3, 3, dtype=torch.float64))], "one floating or complex"),
    # an expanded noise is written as 1000 flat elements over one: free(): invalid next size
    ("aten::rrelu_with_noise", [T(10, -torch.ones(1000)), T([11, _F32, [1000], [0], 0, 4]), 0.1, 0.3, True], {},
     [(10, 0, -torch.ones(1000)), (11, 0, ONE)], "must be contiguous in training"),
    # the .out form with an empty out: its kernel writes self.numel() elements before resizing (SIGSEGV on CPU)
    ("aten::rrelu_with_noise.out", [T(10, torch.tensor(2.5)), T(11, torch.tensor(1.0)), 1.5, 3.0, True],
     {"out": T(12, torch.empty(0))}, [(10, 0, torch.tensor(2.5)), (11, 0, torch.tensor(1.0)), (12, 0, torch.empty(0))],
     "must have self's shape []"),
    ("aten::fractional_max_pool2d_backward", [T(10, torch.ones(1, 1, 2, 2)), T(11, torch.ones(1, 1, 4, 4)), [2, 2],
                                              [2, 2], T(12, _IDX_OUT)], {},
     [(10, 0, torch.ones(1, 1, 2, 2)), (11, 0, torch.ones(1, 1, 4, 4)), (12, 0, _IDX_OUT)], "outside [0, 16)"),
    ("aten::fractional_max_pool3d_backward", [T(10, torch.ones(1, 2, 2, 2)), T(11, torch.ones(1, 4, 4, 4)), [2, 2, 2],
                                              [3, 2, 2], T(12, torch.zeros(1, 2, 2, 2, dtype=torch.int64))], {},
     [(10, 0, torch.ones(1, 2, 2, 2)), (11, 0, torch.ones(1, 4, 4, 4)),
      (12, 0, torch.zeros(1, 2, 2, 2, dtype=torch.int64))], "makes [1, 3, 2, 2]"),
    # rows of no elements for a 0-d input: nothing else bounds the size
    ("aten::nonzero_static", [T(10, torch.tensor(1.0))], {"size": 2**40}, [(10, 0, torch.tensor(1.0))],
     "is outside [0, 2147483647]"),
    ("aten::random_.from", [T(10, V3), 5, 5], {}, [(10, 0, V3)], "from 5 must be less than to 5"),
    # to None on a float tensor: torch's kernel looped forever on from = 2**63 - 1 (found by the fuzzer)
    ("aten::random_.from", [T(10, V3), 2**63 - 1, None], {}, [(10, 0, V3)], "the largest integer a torch.float32"),
    # 10**decimals as an exact integer in the pre-flight's meta run took minutes (found by the fuzzer)
    ("aten::round.decimals_out", [T(10, V3)], {"decimals": -(2**31), "out": T(11, V3)}, [(10, 0, V3), (11, 0, V3)],
     "decimals -2147483648 is outside"),
    # an empty output_size: the meta kernel read past it, SIGSEGV (found by the fuzzer)
    ("aten::fractional_max_pool2d_backward", [T(10, torch.ones(1, 1, 2, 2)), T(11, torch.ones(1, 1, 4, 4)), [2, 2], [],
                                              T(12, _IDX_OUT)], {},
     [(10, 0, torch.ones(1, 1, 2, 2)), (11, 0, torch.ones(1, 1, 4, 4)), (12, 0, _IDX_OUT)],
     "output_size must be 2 positive ints"),
    ("aten::_amp_foreach_non_finite_check_and_unscale_", [[T(10, V3)], T(11, torch.zeros(2)), T(12, ONE)], {},
     [(10, 0, V3), (11, 0, torch.zeros(2)), (12, 0, ONE)], "found_inf must be a one-element torch.float32"),
    ("aten::_amp_update_scale_", [T(10, ONE), T(11, ONE), T(12, ONE), 2.0, 0.5, 2000], {},
     [(10, 0, ONE), (11, 0, ONE), (12, 0, ONE)], "growth_tracker must be a one-element torch.int32"),
])
def test_newly_allowed_kernels_refuse_malformed_arguments_before_running(client, name, args, kwargs, uploads, expect):
    r = client.request([op(name, args, kwargs, outs=[None]), sync(client.next_req())], uploads)
    assert len(r.deferred) == 1, r
    error = r.deferred[0]
    assert expect in error["message"] and "refused before running" in error["message"], error


def test_expanded_indices_and_inputs_are_served_as_contiguous_copies(client):
    """What CUDA takes is taken: embedding_dense_backward with an expanded (stride 0) indices, as BERT's
    token_type_ids buffer gives it, and median over an expanded dim (the CPU kernel read past its storage)."""
    grad = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(0))
    row = torch.tensor([0, 1, 1, 0, 2, 1])
    expanded = T([11, _I64, [3, 6], [0, 1], 0, 48])
    ref = torch.ops.aten.embedding_dense_backward(grad, row.expand(3, 6), 5, -1, False)
    column = torch.tensor([3.0, -1.0, 2.0])
    median_ref = column.expand(100, 3).contiguous().median(0)  # the expanded one reads garbage here too
    r = client.request([
        op("aten::embedding_dense_backward", [T(10, grad), expanded, 5, -1, False], outs=[desc(20, ref)]),
        op("aten::median.dim", [T([12, _F32, [100, 3], [0, 1], 0, 12]), 0],
           outs=[desc(21, median_ref.values), desc(22, median_ref.indices)]),
        sync(client.next_req())], [(10, 0, grad), (11, 0, row), (12, 0, column)])
    assert not r.deferred, r
    torch.testing.assert_close(client.fetch(20, ref), ref)
    assert torch.equal(client.fetch(21, median_ref.values), median_ref.values)
    indices = client.fetch(22, median_ref.indices)
    assert torch.equal(column.expand(100, 3).gather(0, indices.unsqueeze(0)).squeeze(0), median_ref.values)
