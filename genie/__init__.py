"""genie: remote GPUs that feel local to PyTorch.

Public API::

    import genie, torch
    await genie.init(master_addr="gpu-server")      # or genie.init_sync(...)
    x = torch.randn(1000, 1000, device="remote_accelerator:0")
    y = (x @ x).cpu()
    await genie.shutdown()                          # or genie.shutdown_sync()
"""

from __future__ import annotations

from genie._version import __version__
from genie.api import get_cluster_state, init, init_sync, is_initialized, shutdown, shutdown_sync, subscribe
from genie.hookspecs import hookimpl

__all__ = [
    "__version__",
    "get_cluster_state",
    "hookimpl",
    "init",
    "init_sync",
    "is_initialized",
    "shutdown",
    "shutdown_sync",
    "subscribe",
]
