"""Fused optimizer kernels walk each tensor as ``numel`` elements from its data pointer: a session that
sends an expanded (stride-0) parameter or state to ``_fused_adam_``/``_fused_adagrad_`` is refused before
the kernel runs (before: the write ran past the storage and killed the session's worker). Real node
process, raw wire, with a bystander session."""

from __future__ import annotations

import pytest
import torch

from genie.testing import serve_subprocess
from tests.raw_client import T, desc, only_error, op, sync

N = 4096
ONE = torch.zeros(1)


@pytest.fixture(scope="module")
def server():
    """One node process (one CPU device) for this module."""
    with serve_subprocess("--port", "0", "--devices", "cpu") as s:
        yield s


def _expanded(storage_id: int) -> T:
    d = desc(storage_id, ONE)
    d[2], d[3] = [N], [0]  # N elements over a one-element storage
    return T(d)


def _adam(params: list[T], grads: list[T], state: list[T], steps: list[T]) -> bytes:
    return op("aten::_fused_adam_", [params, grads, state, state, [], steps],
              {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
               "maximize": False})


def _adagrad(params: list[T], grads: list[T], state: list[T], steps: list[T]) -> bytes:
    return op("aten::_fused_adagrad_", [params, grads, state, steps],
              {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "eps": 1e-10, "maximize": False})


GRAD = torch.ones(N)
STEP = torch.zeros(())
UPLOADS = [(1, 0, ONE), (2, 0, GRAD), (3, 0, torch.zeros(N)), (4, 0, STEP), (5, 0, torch.zeros(N))]


@pytest.mark.parametrize("make", [_adam, _adagrad], ids=["adam", "adagrad"])
def test_an_expanded_parameter_is_refused_before_the_kernel_runs(client, make):
    cmd = make([_expanded(1)], [T(2, GRAD)], [T(3, GRAD)], [T(4, STEP)])
    error = only_error(client, cmd, UPLOADS)
    assert "refused before running" in error["message"] and "overlaps itself" in error["message"], error


@pytest.mark.parametrize("make", [_adam, _adagrad], ids=["adam", "adagrad"])
def test_a_state_in_another_layout_than_its_parameter_is_refused(client, make):
    cmd = make([T(5, GRAD)], [T(2, GRAD)], [_expanded(1)], [T(4, STEP)])
    error = only_error(client, cmd, UPLOADS)
    assert "refused before running" in error["message"] and "strides [0]" in error["message"], error


def test_a_dense_fused_adagrad_step_still_computes_what_cpu_does(client):
    param, grad, state, step = torch.linspace(-1, 1, N), torch.linspace(1, 2, N), torch.zeros(N), torch.zeros(())
    r = client.request([_adagrad([T(5, param)], [T(2, grad)], [T(3, state)], [T(4, step)]), sync(client.next_req())],
                       [(5, 0, param), (2, 0, grad), (3, 0, state), (4, 0, step)])
    assert not r.deferred, r
    want = param.clone()
    torch.ops.aten._fused_adagrad_([want], [grad], [state.clone()], [step.clone()], lr=1e-2, lr_decay=0.0,
                                   weight_decay=0.0, eps=1e-10, maximize=False)
    assert torch.allclose(client.fetch(5, param), want)
