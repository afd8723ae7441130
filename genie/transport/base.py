"""The transport interface every backend plugin implements.

A transport moves frames between two nodes. It has one asynchronous method,
``probe``, run concurrently with the other transports' probes on the runtime
thread during discovery, and two blocking ones, ``connect`` and ``listen``,
which hand out :class:`Channel` objects: reliable, ordered byte streams with
scatter/gather sends and receives straight into caller-owned memory.

Channels are blocking on purpose: the data plane's fast path runs on the thread
that needs the answer (the user's thread at a sync point, a session thread on the
server), which saves two thread hand-offs per round trip. See docs/architecture.md.

Beside the byte stream a channel may offer a **bulk path** for tensor bytes
(:class:`BulkChannel`): register a memory region, send a region, receive into a
region. Backends with their own memory (shared-memory rings, RDMA memory regions)
implement it natively; :func:`bulk_path` gives every other channel the same API
over its stream, so a caller never needs two code paths. A channel may also want
to know when the peers' handshake is done (:func:`handshake_complete`): the
shared-memory backend hands its segments over only then. Every optional part of a
channel is a :class:`~genie.transport.features.Feature` its class declares
(``features``); the core finds them only through :mod:`genie.transport.features`.
docs/backends.md is the guide for transport authors; :mod:`genie.transport.conformance`
the tests every backend runs.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import attrs

from genie.types import ProbeResult

Buffer = bytes | bytearray | memoryview

@attrs.frozen
class ProbeTarget:
    """Where a probe looks: the peer (usually the master) and how long it may take.

    ``host`` may be empty when there is no peer yet (``genie plugins`` on its own):
    a probe then reports only what the local host supports.
    """

    host: str = ""
    port: int = 0
    timeout: float = 2.0


class Feature(enum.Enum):
    """An optional part of a channel or listener; the value names the Protocol that defines it.

    A class declares the features it offers in ``features`` (a frozenset); the core reads the
    declaration (:func:`declared`), never probes for methods. See :mod:`genie.transport.features`.
    """

    #: :class:`BulkChannel`: a native bulk path (shm, rdma, dpdk).
    BULK = "BulkChannel"
    #: :class:`HandshakeAware`: told when the client's handshake succeeded (shm, rdma, dpdk move to their path).
    HANDSHAKE = "HandshakeAware"
    #: ``features.UpgradeGate``: the server side serves a backend upgrade only once WELCOME went out.
    UPGRADE_GATE = "UpgradeGate"
    #: ``features.NativeStream``: a plain socket genie._C reads frames from (the lane, the native runner).
    NATIVE_STREAM = "NativeStream"
    #: ``features.NativeRecords``: takes back what genie._C read past its frame on a record stream.
    NATIVE_RECORDS = "NativeRecords"
    #: ``features.TlsUpgradable``: a TLS handshake on the stream, and the version in use.
    TLS = "TlsUpgradable"
    #: ``features.Peekable``: the first bytes on the stream, left there (the server's TLS sniffing).
    PEEK = "Peekable"
    #: ``features.HandOver``: the connection can move to a session worker process.
    HANDOVER = "HandOver"
    #: ``features.RelayStream``: partial receives and a descriptor to poll (the node relays TLS plaintext).
    RELAY = "RelayStream"
    #: ``features.Layered``: a channel over another (the record backends' TCP control stream).
    LAYERED = "Layered"
    #: ``features.PreauthLimits`` (listeners): caps on connections still in their handshake.
    PREAUTH_LIMITS = "PreauthLimits"


class HandshakeAware(Protocol):
    """``Feature.HANDSHAKE``: a channel that wants the moment the client's handshake succeeded."""

    def handshake_complete(self, welcome: dict[str, Any]) -> None:
        """Client side: the server's WELCOME checked out; move to the fast path now (see base.handshake_complete)."""


_NONE: frozenset[Feature] = frozenset()


def declared(obj: object) -> frozenset[Feature]:
    """The features ``obj``'s class declares in its ``features`` class attribute (none when it declares none).

    The one place a declaration is read. A declaration that is not a frozenset of :class:`Feature`
    is a bug in the backend: PluginError naming the class.
    """
    features = getattr(type(obj), "features", _NONE)
    if not isinstance(features, frozenset) or not all(isinstance(f, Feature) for f in features):
        from genie.errors import PluginError

        raise PluginError(f"{type(obj).__qualname__}.features must be a frozenset of genie.transport.base.Feature, "
                          f"not {features!r}")
    return features


def offers(obj: object, feature: Feature) -> bool:
    """Whether ``obj``'s class declares ``feature``."""
    return feature in declared(obj)


@runtime_checkable
class Channel(Protocol):
    """A connected, reliable, ordered byte stream between two nodes.

    Everything beyond these four methods is optional and declared: the channel's class lists
    the :class:`~genie.transport.features.Feature` s it offers in ``features`` (a frozenset;
    none when absent), each defined by a small Protocol in :mod:`genie.transport.features`
    (the bulk path, TLS, hand-over to a session worker, genie._C's native stream, ...).
    """

    peer: str

    def sendv(self, buffers: Sequence[Buffer]) -> None:
        """Send every byte of ``buffers`` in order, without joining them first."""

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly; raise ConnectionClosedError if the peer goes away first."""

    def settimeout(self, seconds: float | None) -> None:
        """Bound how long a send or receive may block (None: forever)."""

    def close(self) -> None:
        """Close the stream; further use raises ConnectionClosedError."""


@attrs.frozen(eq=False)
class MemoryRegion:
    """A buffer registered with a channel's bulk path (see :class:`BulkChannel`).

    ``view`` is the registered bytes (a flat ``"B"`` memoryview over host memory, or
    over a CUDA tensor's storage where the backend takes device memory); ``device``
    is ``"cpu"`` or ``"cuda:N"``; ``handle`` is whatever the backend needs to find
    its registration again (an RDMA memory key, a NIXL descriptor list; None for
    stream backends). Regions belong to the channel that registered them.
    """

    view: memoryview
    device: str = "cpu"
    handle: Any = None

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


@attrs.frozen
class Capabilities:
    """What a channel's bulk path can do; exchanged between peers in the handshake.

    ``bulk``: the channel has a native bulk path (not the stream fallback).
    ``device_memory``: memory kinds a region may live in (``("cpu",)``; ``("cpu", "cuda")``
    for GPUDirect-capable backends). ``same_host_only``: the backend refuses peers on
    other hosts. ``zero_copy``: a region crosses without a copy through the kernel.
    """

    backend: str
    bulk: bool = False
    device_memory: tuple[str, ...] = ("cpu",)
    same_host_only: bool = False
    zero_copy: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict for the handshake's backend fields."""
        return {"backend": self.backend, "bulk": self.bulk, "device_memory": list(self.device_memory),
                "same_host_only": self.same_host_only, "zero_copy": self.zero_copy}

    @classmethod
    def from_dict(cls, data: Any) -> Capabilities:
        """Read a peer's capabilities; unknown or malformed fields read as the conservative default."""
        if not isinstance(data, dict) or not isinstance(data.get("backend"), str):
            return cls("unknown")
        memory = data.get("device_memory")
        kinds = tuple(k for k in memory if isinstance(k, str)) if isinstance(memory, list) else ("cpu",)
        return cls(data["backend"], data.get("bulk") is True, kinds or ("cpu",),
                   data.get("same_host_only") is True, data.get("zero_copy") is True)


@runtime_checkable
class BulkChannel(Channel, Protocol):
    """A channel with a bulk path for tensor bytes.

    Bulk transfers are ordered with the stream: ``send_region`` on one side is
    matched by ``recv_region`` of the same size on the other, at the same point of
    the stream (exactly as if the bytes went through ``sendv``/``recv_into``). A
    backend may move them differently (shared-memory rings, one-sided RDMA reads).
    """

    def capabilities(self) -> Capabilities:
        """What this channel's bulk path supports."""

    def register(self, buffer: Any) -> MemoryRegion:
        """Register host memory (anything with the buffer protocol) or, where supported, a CUDA tensor."""

    def deregister(self, region: MemoryRegion) -> None:
        """Release a registration; the region must not be used afterwards."""

    def send_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        """Send ``nbytes`` of ``region`` from ``offset`` (default: to its end); returns when it may be reused."""

    def recv_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        """Receive exactly ``nbytes`` into ``region`` at ``offset`` (default: to its end)."""


def region_view(region: MemoryRegion, offset: int, nbytes: int | None) -> memoryview:
    """The slice of ``region`` a bulk call names; ValueError naming the bounds when it falls outside."""
    end = region.nbytes if nbytes is None else offset + nbytes
    if offset < 0 or end < offset or end > region.nbytes:
        raise ValueError(f"region slice [{offset}:{end}] is outside the registered {region.nbytes} bytes")
    return region.view[offset:end]


def host_view(buffer: Any) -> memoryview:
    """A flat byte view of host memory: a buffer-protocol object or a CPU tensor (contiguous)."""
    if hasattr(buffer, "untyped_storage") and hasattr(buffer, "device"):  # a torch.Tensor, without importing torch
        if buffer.device.type != "cpu":
            raise ValueError(f"this channel's bulk path takes host memory only, not a {buffer.device} tensor; "
                             "copy it to the CPU first or use a backend with device memory (rdma)")
        if not buffer.is_contiguous():
            raise ValueError("register a contiguous tensor (call .contiguous() first)")
        from genie.wire.buffers import tensor_bytes

        return tensor_bytes(buffer)
    view = memoryview(buffer)
    if not view.contiguous:
        raise ValueError("register contiguous memory")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class StreamBulk:
    """The bulk path over a plain channel's stream: what TCP (and any stream-only backend) offers.

    Registration only remembers the view; sending and receiving a region are
    ``sendv``/``recv_into`` of its bytes. Use it through :func:`bulk_path`.
    """

    features: ClassVar[frozenset[Feature]] = frozenset({Feature.BULK})

    def __init__(self, channel: Channel, backend: str = "stream") -> None:
        self.channel = channel
        self.peer = channel.peer
        self._backend = backend

    def capabilities(self) -> Capabilities:
        return Capabilities(self._backend)

    def register(self, buffer: Any) -> MemoryRegion:
        return MemoryRegion(host_view(buffer))

    def deregister(self, region: MemoryRegion) -> None:
        """Nothing to release: the stream never pinned anything."""

    def send_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        self.channel.sendv([region_view(region, offset, nbytes)])

    def recv_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        self.channel.recv_into(region_view(region, offset, nbytes))

    def sendv(self, buffers: Sequence[Buffer]) -> None:
        self.channel.sendv(buffers)

    def recv_into(self, view: memoryview) -> None:
        self.channel.recv_into(view)

    def settimeout(self, seconds: float | None) -> None:
        self.channel.settimeout(seconds)

    def close(self) -> None:
        self.channel.close()


def bulk_path(channel: Channel) -> BulkChannel:
    """``channel`` itself when it declares a bulk path (``Feature.BULK``), else the :class:`StreamBulk` over
    its stream."""
    if offers(channel, Feature.BULK):
        return cast(BulkChannel, channel)
    return StreamBulk(channel)


def capabilities_of(channel: Channel) -> Capabilities:
    """The channel's capabilities (a stream-only channel: ``Capabilities("stream")``), for the handshake."""
    return bulk_path(channel).capabilities()


def handshake_complete(channel: Channel, welcome: dict[str, Any]) -> None:
    """Tell a channel that the client's handshake succeeded (the server authenticated and proved itself).

    Called by the client after it checked WELCOME; a channel that declares
    ``Feature.HANDSHAKE`` (:class:`HandshakeAware`) gets it,
    others nothing. The shared-memory backend hands its segments over here, never before.
    """
    if offers(channel, Feature.HANDSHAKE):
        cast(HandshakeAware, channel).handshake_complete(welcome)


def flat_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """The non-empty buffers as flat byte views (``"B"`` format, one dimension), in order."""
    out = []
    for b in buffers:
        view = memoryview(b)
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if view.nbytes:
            out.append(view)
    return out


class ChannelLifecycle:
    """Closing once, refusing use after close, failing by closing: what every channel needs.

    Subclasses call :meth:`_init_lifecycle` in ``__init__``, start ``close()`` with
    ``if not self._begin_close(): return`` and raise ``self._failed(message)`` when the
    stream can no longer be trusted.
    """

    #: The optional features this class offers (genie.transport.features); subclasses extend the set.
    features: ClassVar[frozenset[Feature]] = frozenset()
    peer: str

    def _init_lifecycle(self) -> None:
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran or the stream failed."""
        return self._closed

    def close(self) -> None:  # pragma: no cover - every channel defines its own
        raise NotImplementedError

    def _begin_close(self) -> bool:
        """Mark closed; False when another call got there first (close is idempotent)."""
        with self._close_lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _check_open(self, what: str) -> None:
        if self._closed:
            from genie.errors import ConnectionClosedError

            raise ConnectionClosedError(f"cannot {what} {self.peer}: the channel is closed")

    def _failed(self, message: str) -> Exception:
        """Close and return the ConnectionClosedError to raise."""
        from genie.errors import ConnectionClosedError

        self.close()
        return ConnectionClosedError(message)


@runtime_checkable
class Listener(Protocol):
    """Accepts channels from peers. Optional, declared as for channels: ``Feature.PREAUTH_LIMITS``."""

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

