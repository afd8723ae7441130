"""out= ops whose outputs are fresh run their functional form on the server: no resize warnings.

Real server process (its own, so its stderr is this test's alone).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from genie.cluster.launch import NodeProcess

D0 = "remote_accelerator:0"


@pytest.fixture(scope="module")
def server() -> Iterator[NodeProcess]:
    import genie

    with NodeProcess("serve", "--port", "0", "--devices", "cpu") as node:
        genie.init_sync(master_addr="127.0.0.1", master_port=node.control_port, timeout=20)
        try:
            yield node
        finally:
            genie.shutdown_sync()


def test_mse_loss_backward_prints_no_resize_warning_on_the_server(server: NodeProcess) -> None:
    """mse_loss reaches the fallback as mse_loss.out with a fresh [] output (once per training step)."""
    torch.manual_seed(2)
    a, b = torch.randn(16, 2), torch.randn(16, 2)
    ra = a.to(D0).requires_grad_()
    loss = nn.functional.mse_loss(ra, b.to(D0))
    loss.backward()
    ca = a.clone().requires_grad_()
    expect = nn.functional.mse_loss(ca, b)
    expect.backward()
    assert torch.equal(loss.detach().cpu(), expect.detach())
    assert ra.grad is not None and ca.grad is not None and torch.equal(ra.grad.cpu(), ca.grad)
    log = server.log()
    assert "was resized" not in log, log[-2000:]


def test_out_arguments_the_user_made_keep_out_semantics(server: NodeProcess) -> None:
    """A user's out= tensor is no fresh output: written in place, cast to its dtype."""
    x = torch.randn(4, 5)
    out = torch.empty(5, dtype=torch.float64, device=D0)
    same = torch.sum(x.to(D0), dim=0, out=out)
    assert same is out and out.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), torch.sum(x, dim=0, out=torch.empty(5, dtype=torch.float64)))
    values, indices = torch.max(x.to(D0), dim=1)
    expect = torch.max(x, dim=1)
    assert torch.equal(values.cpu(), expect.values) and torch.equal(indices.cpu(), expect.indices)
    assert "was resized" not in server.log()
