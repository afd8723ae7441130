"""torch's device-backend autoload entry point (entry point group ``torch.backends``).

``import torch`` calls :func:`autoload` in every process of an environment where genie is installed, so the
``remote_accelerator`` device is registered as torch_npu's is (:func:`genie.device.registration.autoload`).
This module sits outside :mod:`genie.device` on purpose: importing it runs nothing of genie's but the lazy
package face, so torch can import it whichever genie module imported torch first.
"""

from __future__ import annotations

import logging

from genie.local_cuda import local_cuda_here

log = logging.getLogger("genie.device")


def autoload() -> None:
    """Register the device at ``import torch``; never break ``import torch``.

    Not on a host with a local NVIDIA GPU: a registered PrivateUse1 backend becomes torch's accelerator,
    and then every CUDA backward of the process fails inside PyTorch (pytorch/pytorch#161129). Installing
    genie on a GPU host (every ``genie serve`` node, a workstation) must not break the programs there that
    never use it, so there the device registers at genie's first use (``genie.init()``, ``import genie.device``).

    When a genie module that imports torch at its top was the first thing imported (``import
    genie.wire.values`` on its own), that module is still half-made here, and the device's modules need it
    whole: registration then waits for the first import of :mod:`genie.device` (``genie.init()``, any use of
    the device), which registers it.
    """
    if local_cuda_here():
        log.debug("a local GPU is here: remote_accelerator registers at genie.init(), not at torch import")
        return
    try:
        from genie.device.registration import autoload as register
    except ImportError as exc:
        if "partially initialized" in str(exc):
            log.debug("remote_accelerator registration waits for genie.device: %s", exc)
        else:
            log.warning("genie's remote_accelerator device was not registered at torch import: %s", exc)
        return
    register()
