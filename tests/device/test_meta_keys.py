"""The client's meta cache keys float arguments by type, except where their values decide a shape.

Real server process (the ``remote`` fixture); the counters are the client's own
(:func:`genie.device.dispatch.meta_cache`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from genie.device import dispatch
from genie.wire.floats import floats_decide_metadata

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


def _misses() -> int:
    return dispatch.meta_cache().misses


def test_adamw_steps_after_the_first_two_miss_nothing() -> None:
    """lr, step and the bias corrections change every step; none of them may cost a meta miss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)).to(D0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)  # lr changes every step too
    x, y = torch.randn(16, 6).to(D0), torch.randn(16, 2).to(D0)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()

    step()
    step()
    before = _misses()
    for _ in range(3):
        step()
    assert _misses() == before
    model.cpu()


def test_float_values_that_decide_a_shape_stay_in_the_key() -> None:
    """arange's end and an upsampling scale factor change the output's size: a new value is a new entry."""
    a = torch.arange(0.0, 3.5, 0.5, device=D0)
    b = torch.arange(0.0, 5.5, 0.5, device=D0)
    assert a.shape == (7,) and b.shape == (11,)
    torch.testing.assert_close(b.cpu(), torch.arange(0.0, 5.5, 0.5))
    img = torch.randn(1, 1, 4, 4)
    for scale in (1.5, 2.0, 2.5):
        up = nn.functional.interpolate(img.to(D0), scale_factor=scale, mode="nearest")
        expected = nn.functional.interpolate(img, scale_factor=scale, mode="nearest")
        assert up.shape == expected.shape
        torch.testing.assert_close(up.cpu(), expected)


def test_a_new_float_value_reuses_the_entry_and_computes_with_the_new_value() -> None:
    x = torch.randn(5)
    r = x.to(D0)
    r.mul(1.25)
    before = _misses()
    for k in (0.5, -3.0, 7.75):
        torch.testing.assert_close(r.mul(k).cpu(), x.mul(k))
        torch.testing.assert_close(r.add(x.to(D0), alpha=k).cpu(), x.add(x, alpha=k))
    assert _misses() <= before + 1  # add with alpha: one entry for every alpha


def test_the_type_of_a_scalar_stays_in_the_key() -> None:
    """An int tensor times 2 stays int; times 2.5 becomes float: the type decides the dtype."""
    i = torch.arange(4, device=D0)
    assert (i * 2).dtype == torch.int64
    assert (i * 2.5).dtype == torch.float32
    torch.testing.assert_close((i * 2.5).cpu(), torch.arange(4) * 2.5)


def test_floats_decide_metadata_by_schema() -> None:
    aten = torch.ops.aten
    assert not floats_decide_metadata("aten::mul.Scalar", aten.mul.Scalar._schema)
    assert not floats_decide_metadata("aten::_foreach_addcdiv_.ScalarList",
                                               aten._foreach_addcdiv_.ScalarList._schema)
    assert floats_decide_metadata("aten::arange.start_step", aten.arange.start_step._schema)
    assert floats_decide_metadata("aten::upsample_nearest2d.vec", aten.upsample_nearest2d.vec._schema)
    assert floats_decide_metadata("aten::_local_scalar_dense", aten._local_scalar_dense.default._schema)
