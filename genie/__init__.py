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

Profiling a loop::

    genie.stats()                                   # ops queued, round trips, bytes, top sync points
    with genie.profile():                           # prints the same for one block
        ...
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING, Any

from genie._version import __version__

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from genie.api import device, get_cluster_state, init, init_sync, is_initialized, shutdown, shutdown_sync, subscribe
    from genie.device.graphs import Graph
    from genie.device.stats import Profile
    from genie.hookspecs import hookimpl


def stats() -> dict[str, Any]:
    """This process's traffic to remote devices so far: ``ops_queued``, ``round_trips``, ``batches``,
    ``bytes_up``, ``bytes_down``, ``wait_seconds`` (blocked in round trips) and ``sync_points``
    (``{"line", "reason", "count", "seconds"}``, most round trips first). See docs/monitoring.md."""
    from genie.device.stats import STATS

    return STATS.snapshot()


def profile(*, file: IO[str] | None = None, print_table: bool = True) -> AbstractContextManager[Profile]:
    """A context manager that counts what its block asks of remote devices and prints a table at the end
    (to ``file``, default stdout): ops queued, round trips, bytes, time waiting on servers and in the
    client, and the lines of your code that caused the most round trips. The yielded object's ``stats``
    holds the same figures."""
    from genie.device.stats import profile as _profile

    return _profile(file=file, print_table=print_table)


__all__ = [
    "Graph",
    "__version__",
    "device",
    "get_cluster_state",
    "hookimpl",
    "init",
    "init_sync",
    "is_initialized",
    "profile",
    "shutdown",
    "shutdown_sync",
    "stats",
    "subscribe",
]


def __getattr__(name: str) -> Any:
    # Resolved once: the value is stored in the module's namespace, so later lookups are plain attribute reads.
    value: Any
    if name == "hookimpl":
        from genie.hookspecs import hookimpl as value
    elif name == "Graph":  # torch.accelerator.Graph's capture on any torch (genie.device.graphs)
        import genie.api  # noqa: F401  (the runtime a capture needs)
        from genie.device.graphs import Graph as value
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
