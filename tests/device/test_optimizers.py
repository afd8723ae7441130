"""torch's optimizers take their foreach (multi-tensor) path on the device, with CPU's results.

Real server process (the ``remote`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _default_to_fused_or_foreach

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


def test_torch_defaults_to_foreach_on_the_device() -> None:
    params: list[torch.Tensor] = list(nn.Linear(3, 3).to(D0).parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False, use_fused=False) == (False, True)


@pytest.mark.cpu_server
@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "AdamW"])
def test_foreach_steps_are_bit_identical_to_cpu_foreach(opt_name: str) -> None:
    """The device's default (foreach) against CPU forced to foreach: the same kernels, the same bits."""
    def run(device: str) -> list[torch.Tensor]:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)).to(device)
        kwargs = {"momentum": 0.9} if opt_name == "SGD" else {}
        opt = getattr(torch.optim, opt_name)(model.parameters(), lr=0.05, foreach=True if device == "cpu" else None,
                                             **kwargs)
        x, y = torch.randn(16, 6).to(device), torch.randn(16, 2).to(device)
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    for r, c in zip(run(D0), run("cpu"), strict=True):
        assert torch.equal(r, c)
