"""Whether the process could use a local NVIDIA GPU, asked without initialising CUDA.

One question with two askers that must not import each other: torch's autoload (:mod:`genie.autoload`, which
leaves such hosts alone) and the device's registration (:mod:`genie.device.registration`, which warns there).
"""

from __future__ import annotations

import os


def local_cuda_here() -> bool:
    """A CUDA build of torch and a driver's device node (``/dev/nvidiactl``; ``/dev/dxg`` under WSL)."""
    import torch

    return torch.cuda._is_compiled() and any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg"))
