"""Fused and foreach optimizers on the device, op by op and under torch.compile (issue 16).

Real server process (the ``remote`` fixture). Each test trains a small model three steps and
compares every parameter with CPU: bit for bit where both sides run the same kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from genie.compile import replay

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(device: str, opt_name: str, *, backend: str | None = None, compile_step: bool = False,
           **opt_kwargs: Any) -> list[torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)).to(device)
    run = torch.compile(model, backend=backend) if backend else model
    extra = {"momentum": 0.9} if opt_name == "SGD" else {}
    opt = getattr(torch.optim, opt_name)(model.parameters(), lr=0.05, **extra, **opt_kwargs)
    step = torch.compile(opt.step, backend=backend) if backend and compile_step else opt.step
    x, y = torch.randn(16, 6).to(device), torch.randn(16, 2).to(device)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(run(x), y).backward()
        step()
    return [p.detach().cpu() for p in model.parameters()]


def _same(remote: list[torch.Tensor], local: list[torch.Tensor]) -> None:
    assert len(remote) == len(local)
    for i, (r, c) in enumerate(zip(remote, local, strict=True)):
        assert torch.equal(r, c), f"parameter {i} differs by {(r - c).abs().max().item()}"


@pytest.mark.cpu_server
@pytest.mark.parametrize("opt_name", ["AdamW", "Adam", "SGD"])
def test_fused_steps_op_by_op_are_bit_identical_to_cpu_fused(opt_name: str) -> None:
    """``fused=True``: one ``_fused_*_`` op per step (it returns nothing: no output is expected of it)."""
    _same(_train(D0, opt_name, fused=True), _train("cpu", opt_name, fused=True))


@pytest.mark.cpu_server
@pytest.mark.parametrize("opt_name", ["AdamW", "SGD"])
def test_foreach_true_steps_op_by_op_are_bit_identical_to_cpu_foreach(opt_name: str) -> None:
    _same(_train(D0, opt_name, foreach=True), _train("cpu", opt_name, foreach=True))


@pytest.mark.slow
@pytest.mark.cpu_server
def test_fused_adamw_with_a_compiled_model_and_step_matches_cpu() -> None:
    """torch does not trace into fused optimizers (``torch.compiler.disable``): the compiled step runs the
    fused op eagerly on the device, the model's graphs replay; the result equals CPU's fused AdamW."""
    remote = _train(D0, "AdamW", backend="genie", compile_step=True, fused=True)
    _same(remote, _train("cpu", "AdamW", fused=True))


@pytest.mark.slow
@pytest.mark.cpu_server
def test_foreach_adamw_compiled_matches_cpu_compiled_bit_for_bit() -> None:
    """foreach=True compiled: the same aten graph as aot_eager on CPU (its CPU step counters make the step
    graph run op by op on the device, as the backend's rule for written CPU inputs says)."""
    remote = _train(D0, "AdamW", backend="genie", compile_step=True, foreach=True)
    _same(remote, _train("cpu", "AdamW", backend="aot_eager", compile_step=True, foreach=True))


@pytest.mark.slow
def test_capturable_foreach_adamw_step_is_replayed_and_matches_op_by_op() -> None:
    """capturable=True keeps the step counters on the device, so the whole optimizer step is one replay;
    it matches the same optimizer run op by op on the device bit for bit (CPU has no capturable path)."""
    before = replay.counts["replayed"]
    compiled = _train(D0, "AdamW", backend="genie", compile_step=True, foreach=True, capturable=True)
    assert replay.counts["replayed"] - before >= 3 * 3  # forward, backward and step graphs, three steps
    _same(compiled, _train(D0, "AdamW", foreach=True, capturable=True))
    close = _train("cpu", "AdamW", foreach=True)
    for r, c in zip(compiled, close, strict=True):
        torch.testing.assert_close(r, c, rtol=1e-5, atol=1e-5)
