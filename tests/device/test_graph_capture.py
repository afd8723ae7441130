"""torch.accelerator.Graph on remote_accelerator, and genie.Graph (the same capture on any torch), against a real
server process: a captured training step (forward, backward, fused AdamW) replays equal to the same step op by op;
sync points and host copies during capture raise GraphCaptureError; a replay is one command."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import genie
from genie import _C
from genie.device import registry
from genie.errors import GraphCaptureError
from genie.testing import shared_server_devices

D0 = "remote_accelerator:0"
#: On a CUDA server (scripts/gpu-check) the replay runs as a CUDA graph: equal within CUDA's rounding, not bitwise.
CUDA = "cuda" in shared_server_devices()

pytestmark = pytest.mark.usefixtures("remote")


def _accelerator_graph(keep_graph: bool = False) -> Any:
    return torch.accelerator.Graph(keep_graph=keep_graph)


#: Both ways to capture: torch's class (served through genie._C's graph registry, torch 2.13 on) and genie.Graph (any
#: torch: the GPU machine's image has torch 2.11).
GRAPHS = [pytest.param(_accelerator_graph, id="torch.accelerator.Graph", marks=pytest.mark.skipif(
              not hasattr(_C, "register_graph_impl"), reason="this torch has no accelerator graph registry (2.13 added it)")),
          pytest.param(genie.Graph, id="genie.Graph")]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5)) if CUDA else torch.equal(a, b)


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(D0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def _ops_sent() -> int:
    return int(registry.table().get(0).connection.stats["ops"])


@pytest.mark.parametrize("make_graph", GRAPHS)
def test_captured_training_step_replays_equal_to_op_by_op(make_graph: Any) -> None:
    eager_model, eager_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    batches = [torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    # Warm-up step on both (as for CUDA graphs: the optimizer makes its state before the capture).
    eager_loss = _step(eager_model, eager_opt, batches[0].to(D0)).item()
    static_x = batches[0].to(D0)
    assert _step(model, opt, static_x).item() == pytest.approx(eager_loss, rel=0 if not CUDA else 1e-5)

    graph = make_graph()
    before = _ops_sent()
    with graph:
        static_loss = _step(model, opt, static_x)
    assert _ops_sent() == before  # captured, not sent: the parameters did not move
    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert _same(p.cpu(), q.cpu())

    for x in batches[1:]:
        expected = _step(eager_model, eager_opt, x.to(D0)).item()
        static_x.copy_(x)
        sent = _ops_sent()
        graph.replay()
        assert _ops_sent() == sent + 1  # one CMD_REPLAY for forward, backward and the optimizer step
        assert static_loss.item() == pytest.approx(expected, rel=0 if not CUDA else 1e-4)
    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert _same(p.cpu(), q.cpu())
        assert p.grad is not None and q.grad is not None and _same(p.grad.cpu(), q.grad.cpu())
    for a, b in zip(opt.state.values(), eager_opt.state.values(), strict=True):
        assert _same(a["exp_avg_sq"].cpu(), b["exp_avg_sq"].cpu())
        assert torch.equal(a["step"].cpu(), b["step"].cpu())


@pytest.mark.parametrize("make_graph", GRAPHS)
def test_graph_outputs_keep_their_storage_across_replays(make_graph: Any) -> None:
    x = torch.ones(8, device=D0)
    graph = make_graph()
    with graph:
        y = (x * 2).sum()
        x.add_(1)  # an input written in place: every replay
    ptr = y.untyped_storage().data_ptr()
    graph.replay()
    assert y.item() == 16.0
    graph.replay()
    assert y.item() == 32.0 and x.cpu().tolist() == [3.0] * 8
    assert y.untyped_storage().data_ptr() == ptr  # static output: the same storage id, rewritten


@pytest.mark.parametrize("sync", [lambda t: t.item(), lambda t: t.cpu(), lambda t: t.nonzero(),
                                  lambda t: torch.accelerator.synchronize()],
                         ids=["item", "cpu", "nonzero", "synchronize"])
@pytest.mark.parametrize("make_graph", GRAPHS)
def test_sync_point_during_capture_raises_and_invalidates(sync: Any, make_graph: Any) -> None:
    x = torch.ones(4, device=D0)
    graph = make_graph()
    with pytest.raises(GraphCaptureError, match="operation not permitted when stream is capturing"):
        with graph:
            y = (x + 1).sum()
            sync(y)
    with pytest.raises(GraphCaptureError, match="replay\\(\\) needs a captured graph"):
        graph.replay()
    assert (x + 1).sum().item() == 8.0  # the session works as before


@pytest.mark.parametrize("make_graph", GRAPHS)
def test_host_copy_during_capture_raises(make_graph: Any) -> None:
    x = torch.zeros(1024, device=D0)
    graph = make_graph()
    with pytest.raises(GraphCaptureError, match="host-to-device copy"):
        with graph:
            x.copy_(torch.ones(1024))
    assert x.sum().item() == 0.0


@pytest.mark.parametrize("make_graph", GRAPHS)
def test_reset_allows_a_new_capture(make_graph: Any) -> None:
    x = torch.ones(4, device=D0)
    graph = make_graph(keep_graph=True)
    with graph:
        y = x * 3
    graph.replay()
    assert y.cpu().tolist() == [3.0] * 4
    graph.reset()
    with graph:
        z = x * 5
    graph.replay()
    assert z.cpu().tolist() == [5.0] * 4


def test_an_error_inside_a_genie_graph_block_ends_the_capture() -> None:
    """The user's own exception leaves the block as it is; the capture is over (ops run again) and the graph empty."""
    x = torch.ones(4, device=D0)
    graph = genie.Graph()
    with pytest.raises(ValueError, match="the user's"):
        with graph:
            x.mul_(3)
            raise ValueError("the user's")
    assert x.cpu().tolist() == [1.0] * 4  # the captured mul_ never ran, and the copy was not captured
    with pytest.raises(GraphCaptureError, match="replay\\(\\) needs a captured graph"):
        graph.replay()
    with graph:
        y = x * 5
    graph.replay()
    assert y.cpu().tolist() == [5.0] * 4
