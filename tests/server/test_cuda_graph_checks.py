"""A graph replayed as a CUDA graph runs its validators ahead of every replay (genie.server.replay_checks) and draws
from the session's generators (genie.server.cuda_graphs). Graphs are defined and replayed by CMD_GRAPH and
CMD_REPLAY through an in-process executor, each checked against torch run locally.

This machine has no GPU, so ``torch.cuda.CUDAGraph`` is what these tests replace: ``CpuGraphStandIn`` stands in for
it on the executor's CPU device (its capture runs the nodes once, then puts back the inputs' data and the session's
generators' states, as a capture writes and draws nothing; each replay runs them again over the inputs it was captured
with (the replay's, or the buffers they were copied into) into the captured outputs, with no validator run, as a CUDA graph replay runs no Python). Everything else is the
server's own code. tests/server/test_cuda_graphs_gpu.py runs the same graphs on a real CUDA graph
(scripts/gpu-check)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genie.server import cuda_graphs, replay_checks
from genie.wire.graph import Ref
from tests.server.graph_session import Session

aten = torch.ops.aten


class CpuGraphStandIn:
    """Stands in for torch.cuda.CUDAGraph on this GPU-less machine (see the module's docstring)."""

    replays = 0

    def __init__(self, ex: Any, graph: Any) -> None:
        self.graph = graph
        self.generators = ex.generators.on_device(graph.device_index)
        self.env: list[Any] = []
        self.inputs: list[Any] = []
        self.nodes: Any = None

    def capture(self, nodes: Any, env: list[Any]) -> None:
        states = [g.get_state() for g in self.generators]
        self.inputs = env[:self.graph.inputs]  # before the run drops them after their last use
        inputs = [t for v in self.inputs for t in _tensors(v)]
        saved = [t.clone() for t in inputs]
        nodes(env)
        for t, before in zip(inputs, saved, strict=True):  # a CUDA capture writes nothing
            t.copy_(before)
        for g, state in zip(self.generators, states, strict=True):  # and draws nothing
            g.set_state(state)
        self.nodes, self.env = nodes, env

    def replay(self, env: list[Any]) -> None:
        CpuGraphStandIn.replays += 1
        fresh = [*self.inputs, *[None] * len(self.graph.nodes)]  # what the capture read: a CUDA graph's addresses
        with replay_checks.recording(self.graph, []):  # a CUDA graph replay runs no validator
            self.nodes(fresh)
        for slot, kept in enumerate(self.env):
            if kept is not None:  # the capture's outputs: static, written in place by each replay
                for k, v in zip(_tensors(kept), _tensors(fresh[slot]), strict=True):
                    k.copy_(v)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]


@pytest.fixture(autouse=True)
def _stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cuda_graphs.CAPTURES, "cpu", CpuGraphStandIn)


_POOL = [[2, 2], [2, 2], [0, 0], [1, 1], False]
#: max pooling's backward adds each gradient at the input position its index names, unchecked by its CPU kernel:
#: its check (genie.server.index_checks.check_pool_indices) reads the indices, here input 2.
_POOL_BACKWARD = [
    ["aten::max_pool2d_with_indices_backward", [Ref(0), Ref(1), *_POOL, Ref(2)], {}],  # 3
    ["aten::sum", [Ref(3)], {}],                                                        # 4
]


def _expected(grad: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> list[torch.Tensor]:
    out = aten.max_pool2d_with_indices_backward(grad, x, *_POOL, idx)
    return [out, out.sum()]


def _indices(*values: int) -> torch.Tensor:
    return torch.tensor(values).reshape(1, 1, 2, 2)


@pytest.mark.parametrize("program", [True, False])
def test_a_captured_graph_checks_its_input_indices_before_every_replay(program: bool) -> None:
    """Replay 1 is checked in full, replay 2 captures (its check run once, right after), the rest replay the
    capture: new indices are each checked before the replay; indices out of range are refused naming the node,
    with nothing run, and the graph stays captured."""
    torch.manual_seed(0)
    grad, x, idx = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), _indices(0, 3, 8, 15)
    s = Session(_POOL_BACKWARD, [grad, x, idx], [Ref(3), Ref(4)], [torch.empty(1, 1, 4, 4), torch.empty(())],
                program=program)
    for step, indices in enumerate([idx, idx, _indices(5, 5, 1, 2), _indices(15, 14, 13, 12)]):
        s.set_input(2, indices)
        got = s.replay()
        assert isinstance(got, list), got
        assert all(torch.allclose(a, b) for a, b in zip(got, _expected(grad, x, indices), strict=True)), step
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": False, "captured": True}
    replays = CpuGraphStandIn.replays
    s.set_input(2, _indices(0, 1, 2, 16))  # 16: one past the 4x4 plane
    refused = s.replay()
    assert isinstance(refused, dict), refused
    assert "node 0 (aten::max_pool2d_with_indices_backward)" in refused["op"], refused
    assert "refused before running" in refused["message"] and "[-1, 16)" in refused["message"], refused
    assert CpuGraphStandIn.replays == replays  # nothing ran
    s.set_input(2, idx)
    got = s.replay(outputs_at=200)  # the refused replay poisoned 100 and 101, as a failed op does
    assert isinstance(got, list) and torch.allclose(got[0], _expected(grad, x, idx)[0]), got
    assert cuda_graphs.stats(s.graph)["captured"] and CpuGraphStandIn.replays == replays + 1


def test_inputs_at_new_addresses_each_replay_are_copied_into_the_capture_buffers() -> None:
    """The gradient is a new storage every replay (a compiled backward's saved activations are): after it moved
    once the graph is captured again over a buffer it is copied into before each replay, and later replays,
    each with the gradient somewhere new, reuse that capture. The indices, still checked on every replay, move too."""
    torch.manual_seed(0)
    x, idx = torch.randn(1, 1, 4, 4), _indices(0, 3, 8, 15)
    s = Session(_POOL_BACKWARD, [torch.randn(1, 1, 2, 2), x, idx], [Ref(3), Ref(4)],
                [torch.empty(1, 1, 4, 4), torch.empty(())], program=True)
    for step in range(7):
        grad = torch.randn(1, 1, 2, 2)
        s.move_input(0, grad)
        if step >= 4:
            idx = _indices(step, 1, 2, 3)
            s.move_input(2, idx)
        got = s.replay()
        assert isinstance(got, list), got
        assert all(torch.allclose(a, b) for a, b in zip(got, _expected(grad, x, idx), strict=True)), step
    # replay 2 captured over the inputs, replay 3 over a buffer for the gradient, replay 6 one for the indices too
    assert cuda_graphs.stats(s.graph) == {"captures": 3, "eager": False, "captured": True}
    s.move_input(2, _indices(0, 1, 2, 16))
    refused = s.replay()
    assert isinstance(refused, dict) and "[-1, 16)" in refused["message"], refused


def test_a_moved_input_that_a_node_writes_to_gets_the_write() -> None:
    """A node adds to its input in place: where that input is copied into a buffer, the buffer is copied back after
    the replay, so the session's storage holds the sum, as node by node."""
    nodes = [["aten::add_.Tensor", [Ref(0), Ref(1)], {}], ["aten::sum", [Ref(2)], {}]]
    s = Session(nodes, [torch.zeros(8), torch.ones(8)], [Ref(3)], [torch.empty(())], program=True)
    for step in range(6):
        start = torch.full((8,), 10.0 * step)
        s.move_input(0, start)
        got = s.replay()
        assert isinstance(got, list) and float(got[0]) == 8.0 * (10 * step + 1), (step, got)
        assert torch.equal(s.input(0, start), start + 1), step
    assert cuda_graphs.stats(s.graph) == {"captures": 2, "eager": False, "captured": True}


def test_a_check_that_reads_an_intermediate_keeps_its_graph_eager() -> None:
    """The indices are computed by the graph (not an input): their check cannot run ahead of the replay, so the
    graph runs node by node, each validator before its node, and out-of-range indices are still refused."""
    nodes = [["aten::add.Tensor", [Ref(2), Ref(2)], {}],                                    # 3: indices doubled
             ["aten::max_pool2d_with_indices_backward", [Ref(0), Ref(1), *_POOL, Ref(3)], {}],  # 4
             ["aten::sum", [Ref(4)], {}]]                                                     # 5
    grad, x, idx = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), _indices(0, 1, 2, 7)
    s = Session(nodes, [grad, x, idx], [Ref(5)], [torch.empty(())], program=True)
    for _ in range(3):
        got = s.replay()
        assert isinstance(got, list) and torch.allclose(got[0], _expected(grad, x, idx * 2)[1])
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": True, "captured": False}
    s.set_input(2, _indices(0, 1, 2, 8))  # doubled: 16
    refused = s.replay()
    assert isinstance(refused, dict) and "node 1 (aten::max_pool2d_with_indices_backward)" in refused["op"], refused
    assert "refused before running" in refused["message"], refused


def test_a_check_of_an_input_that_a_node_writes_to_keeps_its_graph_eager() -> None:
    """A node doubles the indices in place before the pooling backward reads them: run ahead of the replay, their
    check would see the indices before the write. The graph stays node by node and the doubled index is refused."""
    nodes = [["aten::mul_.Scalar", [Ref(2), 2], {}],                                           # 3: indices *= 2
             ["aten::max_pool2d_with_indices_backward", [Ref(0), Ref(1), *_POOL, Ref(3)], {}],  # 4
             ["aten::sum", [Ref(4)], {}]]                                                     # 5
    grad, x, idx = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), _indices(0, 1, 2, 7)
    s = Session(nodes, [grad, x, idx], [Ref(5)], [torch.empty(())], program=True)
    for _ in range(3):
        s.set_input(2, idx)
        got = s.replay()
        assert isinstance(got, list) and torch.allclose(got[0], _expected(grad, x, idx * 2)[1])
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": True, "captured": False}
    replays = CpuGraphStandIn.replays
    s.set_input(2, _indices(0, 1, 2, 8))  # 8 passes; doubled in place to 16, it does not
    refused = s.replay()
    assert isinstance(refused, dict) and "node 1 (aten::max_pool2d_with_indices_backward)" in refused["op"], refused
    assert CpuGraphStandIn.replays == replays


def test_a_check_of_an_input_written_through_a_view_keeps_its_graph_eager() -> None:
    """The indices are doubled through a view of them (``view`` then ``mul_``): the write reaches the input all the
    same, so its check stays between the nodes and the doubled index is refused."""
    nodes = [["aten::view", [Ref(2), [-1]], {}],                                               # 3: a view
             ["aten::mul_.Scalar", [Ref(3), 2], {}],                                           # 4: the input doubled
             ["aten::max_pool2d_with_indices_backward", [Ref(0), Ref(1), *_POOL, Ref(2)], {}],  # 5
             ["aten::sum", [Ref(5)], {}]]                                                     # 6
    grad, x, idx = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), _indices(0, 1, 2, 7)
    s = Session(nodes, [grad, x, idx], [Ref(6)], [torch.empty(())], program=True)
    for _ in range(3):
        s.set_input(2, idx)
        got = s.replay()
        assert isinstance(got, list) and torch.allclose(got[0], _expected(grad, x, idx * 2)[1])
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": True, "captured": False}
    s.set_input(2, _indices(0, 1, 2, 8))
    refused = s.replay()
    assert isinstance(refused, dict) and "node 2 (aten::max_pool2d_with_indices_backward)" in refused["op"], refused


def test_a_write_to_another_input_leaves_the_indices_check_ahead_of_the_replay() -> None:
    """A node scales the pooled input in place (an optimizer step writes its parameters so): the indices, which no
    node writes, are still checked ahead of each replay, and the graph is captured."""
    nodes = [["aten::mul_.Scalar", [Ref(1), 2], {}],                                           # 3: x *= 2
             ["aten::max_pool2d_with_indices_backward", [Ref(0), Ref(3), *_POOL, Ref(2)], {}],  # 4
             ["aten::sum", [Ref(4)], {}]]                                                     # 5
    grad, x, idx = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), _indices(0, 1, 2, 7)
    s = Session(nodes, [grad, x, idx], [Ref(5)], [torch.empty(())], program=True)
    for _ in range(4):
        got = s.replay()
        assert isinstance(got, list) and torch.allclose(got[0], _expected(grad, x, idx)[1])
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": False, "captured": True}
    replays = CpuGraphStandIn.replays
    s.set_input(2, _indices(0, 1, 2, 16))
    refused = s.replay()
    assert isinstance(refused, dict) and "[-1, 16)" in refused["message"], refused
    assert CpuGraphStandIn.replays == replays


def test_a_check_that_replaces_an_argument_keeps_its_graph_eager() -> None:
    """``_index_put_impl_`` is served with ``unsafe=False`` (its check rewrites the argument): a capture ran without
    that rewrite, so the graph stays eager and every replay runs the check before the node."""
    nodes = [["aten::clone", [Ref(0)], {}],                                                # 3
             ["aten::_index_put_impl_", [Ref(3), [Ref(1)], Ref(2), True, True], {}],     # 4
             ["aten::sum", [Ref(4)], {}]]                                                # 5
    x, idx, values = torch.zeros(5), torch.tensor([0, 2, 2]), torch.ones(3)
    s = Session(nodes, [x, idx, values], [Ref(5)], [torch.empty(())], program=True)
    for _ in range(3):
        got = s.replay()
        assert isinstance(got, list) and float(got[0]) == 3.0
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": True, "captured": False}


def test_a_captured_dropout_draws_new_numbers_from_the_session_generator_each_replay() -> None:
    """native_dropout runs by the session's generator (no generator argument): its graph is captured, and each
    replay draws the mask the next eager draw of that generator would (reseeded by CMD_SEED)."""
    nodes = [["aten::native_dropout", [Ref(0), 0.5, True], {}],  # 1: (output, mask)
             ["aten::sum", [Ref(1, 0)], {}]]                      # 2
    x = torch.ones(64)
    s = Session(nodes, [x], [Ref(1, 0), Ref(1, 1)], [torch.empty(64), torch.empty(64, dtype=torch.bool)],
                program=True)
    s.seed(1234)
    g = torch.Generator().manual_seed(1234)
    masks = []
    for _ in range(4):
        got = s.replay()
        assert isinstance(got, list), got
        expected = torch.empty(64, dtype=torch.bool).bernoulli_(0.5, generator=g)
        assert torch.equal(got[1], expected) and torch.equal(got[0], x * expected * 2.0)
        masks.append(got[1])
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": False, "captured": True}
    assert not torch.equal(masks[2], masks[3])
