"""genie-shm: the same-host shared-memory transport.

Two processes on one host (one kernel, one network namespace) exchange tensors
through sealed memfd rings instead of TCP loopback: no system call per byte, one
copy into the ring and one out. Discovery finds it available when the peer's
address is one of this host's, and it ranks above every network backend
(``PRIORITY_SHM``); on another host its probe says why not and selection moves on.
Segments are handed over only after the peers' authenticated handshake. See
docs/backends.md.
"""

from __future__ import annotations

from typing import Any

from genie import hookimpl
from genie_shm.channel import ShmChannel
from genie_shm.transport import ShmListener, ShmTransport

__all__ = ["ShmChannel", "ShmListener", "ShmTransport", "genie_transports"]


@hookimpl
def genie_transports() -> list[Any]:
    """The shm transport."""
    return [ShmTransport]
