"""genie: remote GPUs that feel local to PyTorch.

Public API::

    import genie, torch
    await genie.init(master_addr="gpu-server")      # or genie.init_sync(...)
    x = torch.randn(1000, 1000, device="remote_accelerator:0")
    y = (x @ x).cpu()
    await genie.shutdown()
"""

from __future__ import annotations

__version__ = "0.1.0"

from genie.hookspecs import hookimpl

__all__ = ["__version__", "hookimpl"]
