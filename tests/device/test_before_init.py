"""Using the device before genie.init() (its own module: no fixture has initialised genie here)."""

from __future__ import annotations

import pytest
import torch

import genie
from genie.errors import NotInitializedError

D0 = "remote_accelerator:0"


def test_using_the_device_before_init_is_a_clear_error() -> None:
    if genie.is_initialized():
        pytest.skip("genie is initialised by another test in this session")
    from genie.device import ensure_registered

    ensure_registered()
    with pytest.raises(NotInitializedError, match="genie.init"):
        torch.zeros(1, device=D0)
