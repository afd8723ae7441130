"""genie: remote GPUs that feel local to PyTorch.

Public API::

    import genie, torch
    await genie.init(master_addr="gpu-server")      # or genie.init_sync(...)
    x = torch.randn(1000, 1000, device="remote_accelerator:0")
    y = (x @ x).cpu()
    await genie.shutdown()                          # or genie.shutdown_sync()

    genie.stats()                                   # ops queued, round trips, bytes, top sync points
    with genie.profile():                           # prints the same for one block
        ...
"""

from __future__ import annotations

from typing import IO, TYPE_CHECKING, Any

__version__ = "0.1.0"

from genie.api import get_cluster_state, init, init_sync, is_initialized, shutdown, shutdown_sync, subscribe
from genie.hookspecs import hookimpl

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from genie.device.stats import Profile


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
    "__version__",
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
