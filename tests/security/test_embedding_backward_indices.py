"""``embedding_dense_backward``'s indices (genie.server.validators.check_embedding_dense_backward): read and
range-checked where the kernel writes by them unchecked (any device but CPU; CPU with ``scale_grad_by_freq``,
whose counting loop wrote past its heap array: 10**11 was a SIGSEGV), and not read on CPU otherwise, where the
kernel skips indices outside its rows. The CUDA rule itself runs on a GPU in tests/server/test_embedding_cuda.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genie.errors import RemoteExecutionError
from genie.server import cuda_graphs, validators
from genie.server.validators import check_embedding_dense_backward, embedding_backward_reads_indices
from genie.testing import serve_subprocess
from genie.wire.graph import Ref
from tests.raw_client import T, desc, op, sync
from tests.server.graph_session import Session
from tests.server.test_cuda_graph_checks import CpuGraphStandIn

LABEL = "aten::embedding_dense_backward.default"
aten = torch.ops.aten


@pytest.fixture(scope="module")
def server():
    with serve_subprocess("--port", "0", "--devices", "cpu") as s:
        yield s


class _OpsSeen(TorchDispatchMode):
    """Records every aten op dispatched while it is active (a read of a tensor's data is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_indices_are_read_everywhere_but_on_cpu_without_scale_grad_by_freq() -> None:
    assert not embedding_backward_reads_indices("cpu", False)
    assert embedding_backward_reads_indices("cpu", True)
    assert embedding_backward_reads_indices("cuda", False)
    assert embedding_backward_reads_indices("cuda", True)
    # a graph's intermediate stands in as a meta tensor ahead of a CUDA graph replay: not trusted unread
    assert embedding_backward_reads_indices("meta", False)
    assert validators.check_for(aten.embedding_dense_backward.default) is check_embedding_dense_backward


def test_cpu_check_reads_no_index_and_the_kernel_skips_those_outside_its_rows() -> None:
    """On CPU without scale_grad_by_freq nothing of the indices is read (no op dispatched at all), an index of
    10 for 10 rows is accepted, and the CPU kernel's result is the sum over the in-range indices alone."""
    grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    indices = torch.tensor([1, 10, 3, 1])
    with _OpsSeen() as seen:
        check_embedding_dense_backward(LABEL, [grad, indices, 10, -1, False], {})
    assert seen.ops == []
    got = aten.embedding_dense_backward(grad, indices, 10, -1, False)
    want = torch.zeros(10, 3)
    want[1] = grad[0] + grad[3]
    want[3] = grad[2]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("index", [10, -1, 10**11])
def test_cpu_check_refuses_an_index_outside_the_rows_with_scale_grad_by_freq(index: int) -> None:
    """The CPU kernel's counts[indices_data[i]]++ writes by the index unchecked: refused before it runs."""
    grad, indices = torch.ones(3, 2), torch.tensor([0, index, 2])
    with pytest.raises(RemoteExecutionError, match=r"refused before running: indices holds values outside \[0, 10\)"):
        check_embedding_dense_backward(LABEL, [grad, indices, 10, -1, True], {})
    check_embedding_dense_backward(LABEL, [grad, torch.tensor([0, 9, 2]), 10, -1, True], {})
    # padding_idx exempts nothing: an index equal to an out-of-range padding_idx is still counted by the kernel
    with pytest.raises(RemoteExecutionError, match="outside"):
        check_embedding_dense_backward(LABEL, [grad, indices], {"num_weights": 10, "padding_idx": index,
                                                               "scale_grad_by_freq": True})


def test_cpu_server_refuses_scale_grad_by_freq_past_the_rows_and_serves_the_rest(client) -> None:
    """On the wire: 10**11 with scale_grad_by_freq (a SIGSEGV of the session worker before) is refused by name,
    the session goes on, and an out-of-range index without it is served as the CPU kernel computes it."""
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    bad, skipped = torch.tensor([0, 10**11, 2]), torch.tensor([0, 10, 2])
    ref = aten.embedding_dense_backward(grad, skipped, 10, -1, False)
    r = client.request([
        op("aten::embedding_dense_backward", [T(10, grad), T(11, bad), 10, -1, True], outs=[desc(20, ref)]),
        sync(client.next_req())], [(10, 0, grad), (11, 0, bad), (12, 0, skipped)])
    assert len(r.deferred) == 1, r
    message = r.deferred[0]["message"]
    assert "refused before running" in message and "outside [0, 10)" in message, message
    r = client.request([op("aten::embedding_dense_backward", [T(10, grad), T(12, skipped), 10, -1, False],
                           outs=[desc(21, ref)]), sync(client.next_req())])
    assert not r.deferred, r
    torch.testing.assert_close(client.fetch(21, ref), ref)


def test_a_captured_graph_checks_the_indices_ahead_of_each_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads only the indices argument, so a graph whose indices are an input stays captured (here on
    CPU with scale_grad_by_freq, which reads them, and tests/server/test_cuda_graph_checks.py's stand-in for the
    CUDA graph; tests/server/test_embedding_cuda.py runs it on a real one): indices out of range are refused
    before the replay runs anything, and the next replay is served."""
    monkeypatch.setitem(cuda_graphs.CAPTURES, "cpu", CpuGraphStandIn)
    grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    good = torch.tensor([0, 3, 3, 9, 1, 0])
    nodes = [["aten::embedding_dense_backward", [Ref(0), Ref(1), 10, -1, True], {}]]
    s = Session(nodes, [grad, good], [Ref(2)], [torch.empty(10, 4)], program=True)
    for step in range(4):
        indices = torch.roll(good, step)
        s.set_input(1, indices)
        got = s.replay()
        assert isinstance(got, list), got
        torch.testing.assert_close(got[0], aten.embedding_dense_backward(grad, indices, 10, -1, True))
    assert cuda_graphs.stats(s.graph) == {"captures": 1, "eager": False, "captured": True}
    replays = CpuGraphStandIn.replays
    s.set_input(1, torch.tensor([0, 1, 2, 10**11, 4, 5]))  # a SIGSEGV in the kernel's counting loop
    refused = s.replay()
    assert isinstance(refused, dict) and "outside [0, 10)" in refused["message"], refused
    assert CpuGraphStandIn.replays == replays  # nothing ran
    s.set_input(1, good)
    got = s.replay(outputs_at=200)
    assert isinstance(got, list), got
    torch.testing.assert_close(got[0], aten.embedding_dense_backward(grad, good, 10, -1, True))
