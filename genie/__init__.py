"""genie: remote GPUs that feel local to PyTorch.

Public API::

    import genie, torch
    await genie.init(master_addr="gpu-server")      # or genie.init_sync(...)
    x = torch.randn(1000, 1000, device="remote_accelerator:0")
    y = (x @ x).cpu()
    await genie.shutdown()                          # or genie.shutdown_sync()

The face is lazy (PEP 562): ``import genie`` loads only the version; the runtime's modules
load on first use of a public name. No module of the package imports this face, so a low
module (``genie.errors``, ``genie.wire.*``) never drags in the runtime, and the package has
no import circle (``tests/test_imports.py``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from genie._version import __version__

if TYPE_CHECKING:
    from genie.api import device, get_cluster_state, init, init_sync, is_initialized, shutdown, shutdown_sync, subscribe
    from genie.hookspecs import hookimpl

__all__ = [
    "__version__",
    "device",
    "get_cluster_state",
    "hookimpl",
    "init",
    "init_sync",
    "is_initialized",
    "shutdown",
    "shutdown_sync",
    "subscribe",
]


def __getattr__(name: str) -> Any:
    # Resolved once: the value is stored in the module's namespace, so later lookups are plain attribute reads.
    value: Any
    if name == "hookimpl":
        from genie.hookspecs import hookimpl as value
    elif name == "device":  # the device package, callable once genie.api has loaded: genie.device(min_memory=...)
        import genie.api  # noqa: F401  (makes the package callable)

        value = sys.modules["genie.device"]
    elif name in __all__:
        from genie import api

        value = getattr(api, name)
    else:
        raise AttributeError(f"module 'genie' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
