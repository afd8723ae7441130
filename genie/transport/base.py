"""The transport interface every backend plugin implements.

A transport moves frames between two nodes. It has one asynchronous method,
``probe``, run concurrently with the other transports' probes on the runtime
thread during discovery, and two blocking ones, ``connect`` and ``listen``,
which hand out :class:`Channel` objects: reliable, ordered byte streams with
scatter/gather sends and receives straight into caller-owned memory.

Channels are blocking on purpose: the data plane's fast path runs on the thread
that needs the answer (the user's thread at a sync point, a session thread on the
server), which saves two thread hand-offs per round trip. See docs/architecture.md.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs

from genie.types import ProbeResult

Buffer = bytes | bytearray | memoryview

#: Default ranks (higher wins): dpdk_gpudev > rdma > dpdk > tcp.
PRIORITY_DPDK_GPUDEV = 400
PRIORITY_RDMA = 300
PRIORITY_DPDK = 200
PRIORITY_TCP = 100


@attrs.frozen
class ProbeTarget:
    """Where a probe looks: the peer (usually the master) and how long it may take.

    ``host`` may be empty when there is no peer yet (``genie plugins`` on its own):
    a probe then reports only what the local host supports.
    """

    host: str = ""
    port: int = 0
    timeout: float = 2.0


@runtime_checkable
class Channel(Protocol):
    """A connected, reliable, ordered byte stream between two nodes."""

    peer: str

    def sendv(self, buffers: Sequence[Buffer]) -> None:
        """Send every byte of ``buffers`` in order, without joining them first."""

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly; raise ConnectionClosedError if the peer goes away first."""

    def settimeout(self, seconds: float | None) -> None:
        """Bound how long a send or receive may block (None: forever)."""

    def close(self) -> None:
        """Close the stream; further use raises ConnectionClosedError."""


@runtime_checkable
class Listener(Protocol):
    """Accepts channels from peers."""

    host: str
    port: int

    def accept(self, timeout: float | None = None) -> Channel:
        """Wait for the next peer; raise TimeoutError when ``timeout`` passes first."""

    def close(self) -> None:
        """Stop listening."""


class Transport(abc.ABC):
    """A network backend. Subclasses set ``name`` and ``default_priority``."""

    name: ClassVar[str]
    default_priority: ClassVar[int] = 0

    @abc.abstractmethod
    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """Find whether this backend works between here and ``target``; never raise for "no"."""

    @classmethod
    def host_fingerprint(cls) -> dict[str, Any] | None:
        """What this transport's probe result depends on, if it depends only on this host.

        Return None (the default) when the result depends on the peer (TCP measures the
        round trip to the master): discovery then probes every time. Otherwise return a
        small JSON-able dict of everything that could change the answer (library paths
        and mtimes, device listings; see :func:`genie.transport.cache.path_fingerprint`):
        discovery caches the result, in process and on disk, until the dict changes.
        Must be cheap (a few ``stat`` calls) and must not import native libraries.
        """
        return None

    @abc.abstractmethod
    def connect(self, host: str, port: int, *, timeout: float) -> Channel:
        """Open a channel to a listening peer."""

    @abc.abstractmethod
    def listen(self, host: str, port: int) -> Listener:
        """Listen for channels on ``host:port`` (port 0: any free port)."""


class ProbeOnlyTransport(Transport):
    """A backend whose probe is real but whose data path this release does not have.

    ``connect`` and ``listen`` refuse with :class:`~genie.errors.BackendUnavailableError`
    carrying ``no_data_path`` (the plugin's own explanation); its probe results set
    ``details["data_path"] = False`` so selection never makes it a candidate.
    """

    no_data_path: ClassVar[str] = "this backend has no data path in this release"

    @staticmethod
    async def run_blocking_probe(fn: Any, target: ProbeTarget, *args: Any) -> Any:
        """Run a blocking probe ``fn(timeout, *args)`` in a worker thread, abandoned if discovery gives up.

        ``timeout`` is 90 % of the target's deadline (at least 0.2 s), so a stuck native
        library is reported with its own words before discovery's deadline passes.
        """
        import anyio.to_thread

        timeout = max(0.2, target.timeout * 0.9)
        return await anyio.to_thread.run_sync(fn, timeout, *args, abandon_on_cancel=True)

    def connect(self, host: str, port: int, *, timeout: float) -> Channel:
        """Refuse: there is no data path."""
        from genie.errors import BackendUnavailableError

        raise BackendUnavailableError(self.no_data_path)

    def listen(self, host: str, port: int) -> Listener:
        """Refuse: there is no data path."""
        from genie.errors import BackendUnavailableError

        raise BackendUnavailableError(self.no_data_path)

