"""Hardware-only (a CUDA GPU; scripts/gpu-check runs it): graphs replayed as real CUDA graphs
(genie.server.cuda_graphs) in an in-process executor on cuda:0, checked against torch run locally on that GPU.
The same graphs run on CPU, with a stand-in for the CUDA graph, in tests/server/test_cuda_graph_checks.py."""

from __future__ import annotations

import pytest
import torch

from genie.server import cuda_graphs
from genie.wire.graph import Ref
from tests.server.graph_session import Session
from tests.server.test_cuda_graph_checks import _POOL, _POOL_BACKWARD, _indices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware-only: needs a CUDA GPU")
aten = torch.ops.aten
CUDA = "cuda:0"


def test_a_cuda_graph_checks_its_input_indices_before_every_replay() -> None:
    """Captured on the second replay; each later replay's indices are checked before the graph launches, and an
    index out of range is refused by name with nothing launched (no device-side assert: the session goes on)."""
    torch.manual_seed(0)
    grad, x, idx = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), _indices(0, 3, 8, 15)
    s = Session(_POOL_BACKWARD, [grad, x, idx], [Ref(3), Ref(4)], [torch.empty(1, 1, 4, 4), torch.empty(())],
                program=True, device=CUDA)
    for indices in [idx, idx, _indices(5, 5, 1, 2), _indices(15, 14, 13, 12)]:
        s.set_input(2, indices)
        got = s.replay()
        assert isinstance(got, list), got
        want = aten.max_pool2d_with_indices_backward(grad.to(CUDA), x.to(CUDA), *_POOL, indices.to(CUDA)).cpu()
        assert torch.allclose(got[0], want) and torch.allclose(got[1], want.sum())
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": False, "captured": True}
    s.set_input(2, _indices(0, 1, 2, 16))
    refused = s.replay()
    assert isinstance(refused, dict) and "refused before running" in refused["message"], refused
    s.set_input(2, idx)
    got = s.replay(outputs_at=200)
    assert isinstance(got, list), got
    torch.cuda.synchronize()


def test_a_cuda_graph_draws_each_replays_dropout_from_the_session_generator() -> None:
    """The session's generator is registered with the capture: every replay draws a new mask, the one the next
    eager draw of a CUDA generator seeded alike gives."""
    nodes = [["aten::native_dropout", [Ref(0), 0.5, True], {}], ["aten::sum", [Ref(1, 0)], {}]]
    x = torch.ones(4096)
    s = Session(nodes, [x], [Ref(1, 0), Ref(1, 1)], [torch.empty(4096), torch.empty(4096, dtype=torch.bool)],
                program=True, device=CUDA)
    s.seed(1234)
    g = torch.Generator(device=CUDA).manual_seed(1234)
    masks = []
    for step in range(5):
        got = s.replay()
        assert isinstance(got, list), got
        expected = torch.empty(4096, dtype=torch.bool, device=CUDA).bernoulli_(0.5, generator=g).cpu()
        assert torch.equal(got[1], expected), f"replay {step}: not the generator's next draw"
        assert torch.equal(got[0], x * expected * 2.0)
        masks.append(got[1])
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": False, "captured": True}
    assert not torch.equal(masks[3], masks[4])


def test_a_cuda_graph_copies_inputs_that_move_into_its_buffers() -> None:
    """A new gradient storage every replay: captured again once over a buffer, then each replay copies the gradient
    in (device to device) and equals torch run locally on the GPU."""
    x, idx = torch.randn(1, 1, 4, 4), _indices(0, 3, 8, 15)
    s = Session(_POOL_BACKWARD, [torch.randn(1, 1, 2, 2), x, idx], [Ref(3), Ref(4)],
                [torch.empty(1, 1, 4, 4), torch.empty(())], program=True, device=CUDA)
    for _ in range(6):
        grad = torch.randn(1, 1, 2, 2)
        s.move_input(0, grad)
        got = s.replay()
        assert isinstance(got, list), got
        want = aten.max_pool2d_with_indices_backward(grad.to(CUDA), x.to(CUDA), *_POOL, idx.to(CUDA)).cpu()
        assert torch.allclose(got[0], want)
    assert cuda_graphs.stats(s.graph) == {"captures": 2, "eager": False, "captured": True}
