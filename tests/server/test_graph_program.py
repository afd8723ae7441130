"""An admitted replay runs its nodes in C++ (genie._C_plans.GraphProgram, genie/csrc/server/graph_program.cpp) and
computes what the Python loop of genie.server.graphs computes: the same bits, the same error record naming the
same node, empty-family results zeroed, validators still run before their node on every replay. Each case runs a
real graph (CMD_GRAPH, then CMD_REPLAY) in two in-process executors over a fake channel: one with the program,
one whose graph is kept on the Python loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genie.server import graphs
from genie.wire.graph import Ref
from tests.raw_client import Dev
from tests.server.graph_session import Session

pytestmark = pytest.mark.skipif(graphs.GraphProgram is None, reason="genie._C_plans was not built")

def _both(nodes: list[list[Any]], inputs: list[torch.Tensor], outputs: list[Ref],
          like: list[torch.Tensor]) -> tuple[Session, Session]:
    return (Session(nodes, inputs, outputs, like, program=True), Session(nodes, inputs, outputs, like, program=False))


def test_a_replay_by_the_program_equals_the_python_loop_bit_for_bit() -> None:
    """Top-level, nested (cat's tensors, index's optional tensors) and keyword (out=) references, multi-output
    nodes' items, a node with a validator (run by the program's Python callable), slots released on the way."""
    torch.manual_seed(0)
    x, w, b, idx = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16), torch.tensor([3, 1, 7])
    nodes: list[list[Any]] = [
        ["aten::addmm", [Ref(2), Ref(0), Ref(1)], {}],                                   # 4
        ["aten::relu", [Ref(4)], {}],                                                     # 5
        ["aten::native_layer_norm", [Ref(5), [16], None, None, 1e-5], {}],               # 6: three outputs
        ["aten::cat", [[Ref(6, 0), Ref(5)], 1], {}],                                      # 7
        ["aten::empty.memory_format", [[8, 32]], {"dtype": torch.float32, "device": Dev(0)}],  # 8
        ["aten::mul.out", [Ref(7), Ref(7)], {"out": Ref(8)}],                                  # 9: out=
        ["aten::median.dim", [Ref(9), 1], {}],                # 10: a validator's op: a Python node, two outputs
        ["aten::index.Tensor", [Ref(10, 0), [Ref(3)]], {}],  # 11: Tensor?[]
        ["aten::sum", [Ref(11)], {}],                         # 12
    ]
    like = [torch.empty(3), torch.empty(()), torch.empty(8, 1)]
    with_program, python_loop = _both(nodes, [x, w, b, idx], [Ref(11), Ref(12), Ref(6, 1)], like)
    for step in range(4):  # the first replay is checked in full (Python), the rest are admitted
        if step:
            new = torch.randn(8, 16)
            with_program.set_input(0, new)
            python_loop.set_input(0, new)
        a, b_ = with_program.replay(), python_loop.replay()
        assert isinstance(a, list) and isinstance(b_, list), (a, b_)
        assert all(torch.equal(p, q) for p, q in zip(a, b_, strict=True))
    program = with_program.graph.program
    assert program and program.python_nodes() == 1  # aten::median.dim alone (it has a validator)
    assert python_loop.graph.program is False
    assert with_program.graph.replays == 4 and with_program.graph.checked_runs == 1


def test_a_node_failing_in_the_program_is_named_as_the_python_loop_names_it() -> None:
    """A plain node failing on data (a Cholesky factor of a matrix that is not positive definite) on an admitted
    replay: the same deferred error, naming the node, its op and its arguments' shapes."""
    spd = torch.eye(4) * 2
    nodes = [["aten::mul.Scalar", [Ref(0), 1.0], {}], ["aten::linalg_cholesky", [Ref(1)], {}], ["aten::sum", [Ref(2)], {}]]
    sessions = _both(nodes, [spd], [Ref(3)], [torch.empty(())])
    errors = []
    for s in sessions:
        assert isinstance(s.replay(), list)  # checked in full, fine
        s.set_input(0, -spd)
        errors.append(s.replay())
    assert isinstance(errors[0], dict) and errors[0] == errors[1], errors
    assert "node 1 (aten::linalg_cholesky)" in errors[0]["op"] and errors[0]["shapes"] == [[4, 4]]
    assert sessions[0].graph.program and sessions[0].replay() != []  # the next replay fails again, no crash


def test_the_program_zeroes_what_an_empty_family_node_hands_out() -> None:
    """A block freed inside the replay (its slot released) is what the next allocation of its size gets: the
    empty node's result is zeroed, as the op path zeroes it, never the freed block's sevens."""
    nodes: list[list[Any]] = [
        ["aten::mul.Scalar", [Ref(0), 7.0], {}],                                          # 1: sevens
        ["aten::sum", [Ref(1)], {}],                                                      # 2: slot 1 released here
        ["aten::empty.memory_format", [[1024]], {"dtype": torch.float32, "device": Dev(0)}],  # 3
        ["aten::add.Tensor", [Ref(3), Ref(2)], {}],                                       # 4
    ]
    like = [torch.empty(1024)]
    for s in _both(nodes, [torch.ones(1024)], [Ref(4)], like):
        for _ in range(3):
            got = s.replay()
            assert isinstance(got, list) and torch.equal(got[0], torch.full((1024,), 7168.0)), got


def test_a_node_asking_for_a_composite_kernel_runs_it_from_cpp() -> None:
    """A node the client lowered to an op's composite kernel (its device has none of its own: genie.compile.lower)
    is called for that kernel by the program, as OpOverload._op_dk calls it, with the same bits."""
    torch.manual_seed(0)
    nodes: list[list[Any]] = [
        ["aten::t", [Ref(0)], {}, "CompositeExplicitAutograd"],                        # 2
        ["aten::mm", [Ref(1), Ref(2)], {}],                                             # 3
        ["aten::sum.dim_IntList", [Ref(3), [0], True], {}, "CompositeExplicitAutogradNonFunctional"],  # 4
    ]
    like = [torch.empty(1, 8)]
    sessions = _both(nodes, [torch.randn(8, 16), torch.randn(4, 16)], [Ref(4)], like)
    for _ in range(3):
        a, b = (s.replay() for s in sessions)
        assert isinstance(a, list) and isinstance(b, list) and torch.equal(a[0], b[0]), (a, b)
    program = sessions[0].graph.program
    assert program and program.python_nodes() == 0


def test_a_python_node_failing_on_data_is_named_as_the_python_loop_names_it() -> None:
    """A node with a validator runs through the program's Python callable; when the validator refuses the data of
    an admitted replay (a max-pooling gradient's index past its input plane), the error is the Python loop's."""
    grad, x = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4)
    good, bad = torch.tensor([[[[0, 3], [9, 15]]]]), torch.tensor([[[[0, 3], [99, 15]]]])
    nodes: list[list[Any]] = [
        ["aten::max_pool2d_with_indices_backward", [Ref(0), Ref(1), [2, 2], [2, 2], [0, 0], [1, 1], False, Ref(2)], {}],
        ["aten::sum", [Ref(3)], {}],
    ]
    sessions = _both(nodes, [grad, x, good], [Ref(4)], [torch.empty(())])
    errors = []
    for s in sessions:
        assert isinstance(s.replay(), list) and isinstance(s.replay(), list)  # checked, then admitted
        s.set_input(2, bad)
        errors.append(s.replay())
    assert isinstance(errors[0], dict) and errors[0] == errors[1], errors
    assert "node 0 (aten::max_pool2d_with_indices_backward)" in errors[0]["op"], errors[0]
    assert "outside" in errors[0]["message"], errors[0]
    program = sessions[0].graph.program
    assert program and program.python_nodes() == 1


@pytest.mark.parametrize(("out", "grew"), [(torch.empty(4, 4), False), (torch.empty(0), True)],
                         ids=["right-size", "grown"])
def test_a_gate_says_whether_its_checked_replay_grew_an_input_storage(out: torch.Tensor, grew: bool) -> None:
    """An out= node (every op of a torch.accelerator.Graph capture is one) no longer keeps a graph from becoming a
    CUDA graph (cuda_graphs.eligible); a signature whose replay grows an input's storage (here: out= into an empty
    one) does, through its gate (Gate.grew: a reallocated storage would leave a CUDA graph writing to the old
    address). The CUDA capture itself is hardware-only (tests/device/test_graph_capture.py under gpu-check)."""
    from genie.server import cuda_graphs

    nodes: list[list[Any]] = [["aten::mm.out", [Ref(0), Ref(0)], {"out": Ref(1)}]]  # 2
    s = Session(nodes, [torch.randn(4, 4), out], [Ref(2)], [torch.empty(4, 4)], program=True)
    assert s.graph.resizes and cuda_graphs.eligible(s.graph)
    assert isinstance(s.replay(), list)
    (gate,) = s.graph.gates.values()
    assert gate.grew is grew
