"""Hardware-only (a CUDA GPU; scripts/gpu-check runs it): ``embedding_dense_backward`` on a cuda:0 executor refuses
an index outside [0, num_weights) before its kernel runs (CUDA's kernels write by it unchecked:
genie.server.validators.check_embedding_dense_backward) and serves indices inside, equal to torch run locally on
that GPU, by op and as a graph replayed as a CUDA graph (the check reads only the graph's input indices, so the
graph stays captured). The CPU side of the rule is tests/security/test_embedding_backward_indices.py."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from genie.server import cuda_graphs
from genie.server.executor import Executor
from genie.server.store import StorageStore
from genie.wire.frame import FrameHeader, MsgKind
from genie.wire.graph import Ref
from tests.raw_client import T, desc, op, pack_body
from tests.server.graph_session import Session
from tests.transport.transport_fakes import FakeChannel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware-only: needs a CUDA GPU")
aten = torch.ops.aten
CUDA = "cuda:0"
ROWS, WIDTH = 10, 8
_ids = itertools.count(1)


def _run_op(ex: Executor, store: StorageStore, grad: torch.Tensor, indices: torch.Tensor,
            by_freq: bool) -> torch.Tensor | dict[str, Any]:
    """``embedding_dense_backward`` by CMD_OP on ``ex``: its result, or the deferred error it left."""
    grad_id, indices_id, out = next(_ids), next(_ids), next(_ids)  # storage ids are never reused
    store.put(grad_id, grad.to(CUDA).untyped_storage())
    store.put(indices_id, indices.to(CUDA).untyped_storage())
    like = torch.empty(ROWS, WIDTH)
    cmd = op("aten::embedding_dense_backward", [T(grad_id, grad), T(indices_id, indices), ROWS, -1, by_freq],
             outs=[desc(out, like)])
    body = pack_body({"uploads": [], "cmds": [cmd]})
    ex.run_batch(FrameHeader(MsgKind.BATCH, len(body), 0), body)
    if ex.deferred:
        return ex.deferred.pop(0)
    storage = store.get(out)
    assert storage is not None
    return torch.empty(0, device=CUDA).set_(storage, 0, like.shape, like.stride()).cpu()


@pytest.mark.parametrize(("count", "by_freq"), [(6, False), (4096, False), (6, True)],
                         ids=["feature-kernel", "sorted-kernel", "scale-grad-by-freq"])
def test_cuda_op_refuses_indices_outside_the_rows_and_serves_those_inside(count: int, by_freq: bool) -> None:
    """Both CUDA kernels (up to 3072 indices: the feature kernel; more: sum_and_scatter) and scale_grad_by_freq:
    ROWS, -1 and 2**40 are refused by name with nothing launched; in-range indices give torch's own result."""
    store = StorageStore(max_bytes=1 << 30)
    ex = Executor(FakeChannel("test"), store, [torch.device(CUDA)])
    g = torch.Generator().manual_seed(count)
    grad = torch.randn(count, WIDTH, generator=g)
    good = torch.randint(0, ROWS, (count,), generator=g)
    for bad_value in (ROWS, -1, 2**40):
        bad = good.clone()
        bad[count // 2] = bad_value
        refused = _run_op(ex, store, grad, bad, by_freq)
        assert isinstance(refused, dict), f"index {bad_value} was not refused"
        assert "refused before running" in refused["message"] and f"outside [0, {ROWS})" in refused["message"], \
            refused
    got = _run_op(ex, store, grad, good, by_freq)
    assert isinstance(got, torch.Tensor), got
    want = aten.embedding_dense_backward(grad.to(CUDA), good.to(CUDA), ROWS, -1, by_freq).cpu()
    torch.testing.assert_close(got, want)
    torch.cuda.synchronize()


def test_cuda_graph_checks_embedding_backward_indices_before_every_replay() -> None:
    """A graph of one embedding_dense_backward over input indices is captured as a CUDA graph (its check reads
    only those indices, so it runs ahead of each replay), and a replay whose indices leave the rows is refused
    with nothing launched; the session's next replay is served."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(6, WIDTH, generator=g)
    good = torch.randint(0, ROWS, (6,), generator=g)
    nodes = [["aten::embedding_dense_backward", [Ref(0), Ref(1), ROWS, -1, False], {}]]
    s = Session(nodes, [grad, good], [Ref(2)], [torch.empty(ROWS, WIDTH)], program=True, device=CUDA)
    for step in range(4):
        indices = torch.roll(good, step)
        s.set_input(1, indices)
        got = s.replay()
        assert isinstance(got, list), got
        want = aten.embedding_dense_backward(grad.to(CUDA), indices.to(CUDA), ROWS, -1, False).cpu()
        torch.testing.assert_close(got[0], want)
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": False, "captured": True}
    s.set_input(1, torch.tensor([0, 1, 2, ROWS, 4, 5]))
    refused = s.replay()
    assert isinstance(refused, dict) and f"outside [0, {ROWS})" in refused["message"], refused
    s.set_input(1, good)
    got = s.replay(outputs_at=200)
    assert isinstance(got, list), got
    torch.testing.assert_close(got[0], aten.embedding_dense_backward(grad.to(CUDA), good.to(CUDA), ROWS, -1,
                                                                     False).cpu())
    torch.cuda.synchronize()
