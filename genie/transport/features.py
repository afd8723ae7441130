"""The optional parts of a channel (and a listener), each a named, declared :class:`Feature`.

:class:`~genie.transport.base.Channel` is four methods. Beside them a backend's channel may
offer more: a native bulk path, a TLS upgrade, a socket that can move to a session worker,
the stream genie._C's lane reads. Each such part is a :class:`Feature` with a small
``Protocol`` below naming its members exactly. A channel class *declares* what it offers::

    class MyChannel(ChannelLifecycle):
        features = frozenset({Feature.TLS, Feature.PEEK})

and the core asks for a part only through the helpers here (:func:`tls_of`,
:func:`native_stream_of`, ...), which read that declaration: never a ``getattr`` or
``hasattr`` on the channel, so a method that happens to carry a name is never taken for a
feature, and every call site sees a typed interface. :func:`~genie.transport.base.declared`
is the one place a declaration is read (:class:`Feature`, :func:`declared`, :func:`offers` and
:class:`HandshakeAware` live in :mod:`genie.transport.base`, next to Channel, and are
re-exported here). A class that declares nothing offers nothing optional; subclasses extend
their base's set (``features = RecordChannel.features | {Feature.BULK}``).

The conformance suite (:mod:`genie.transport.conformance`) checks both directions for
every backend: each declared feature has every member of its Protocol with the right
signature and works, and no member of an undeclared feature is implemented.
docs/backends.md says what each feature is for, who uses it, and what happens without it.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from typing import Any, Protocol, cast

from genie.transport.base import BulkChannel, Channel, Feature, HandshakeAware, declared, offers

__all__ = [
    "Feature", "HandshakeAware", "UpgradeGate", "NativeStream", "NativeRecords", "TlsUpgradable", "Peekable",
    "HandOver", "RelayStream", "Layered", "PreauthLimits", "protocols", "declared", "offers", "handshake_aware",
    "allow_upgrade", "native_stream_of", "native_stream", "native_records_of", "tls_of", "peekable", "handover_of",
    "relay_stream_of", "inner_of", "preauth_limits_of",
]


class UpgradeGate(Protocol):
    """``Feature.UPGRADE_GATE``: the session opens the gate once WELCOME went out (record backends)."""

    def allow_upgrade(self) -> None:
        """Server side: WELCOME went out, so the client's one backend upgrade may be served."""


class NativeStream(Protocol):
    """``Feature.NATIVE_STREAM``: the socket genie._C reads frames from (client lane, server native runner)."""

    def native_stream(self) -> tuple[int, bool] | None:
        """``(descriptor, records)``: a plain blocking socket carrying this channel's frames (``records``:
        inside INLINE records), or None now (TLS, not upgraded, closed)."""

    def at_rest(self) -> bool:
        """True when nothing received is kept on this side (the next byte is on the socket)."""


class NativeRecords(Protocol):
    """``Feature.NATIVE_RECORDS``: what genie._C read on a record stream, handed back to the channel."""

    def unread(self, data: bytes) -> None:
        """Stream bytes genie._C read past its frame: received first from now on."""

    def resume_record(self, partial: bytes, kind: int, length: int) -> None:
        """genie._C read ``partial`` stream bytes, then the header of a record only the channel reads."""


class TlsUpgradable(Protocol):
    """``Feature.TLS``: TLS on the stream (genie.wire.handshake; the node sniffs it with ``Peekable``)."""

    def start_tls(self, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None) -> None:
        """Run a TLS handshake on the stream; ConnectionClosedError (closed) when it fails."""

    @property
    def tls_version(self) -> str | None:
        """The TLS version in use, or None on a plain stream."""


class Peekable(Protocol):
    """``Feature.PEEK``: the first bytes without consuming them (the server tells TLS from plain genie)."""

    def peek(self, nbytes: int) -> bytes:
        """Up to ``nbytes`` the peer sent, left in the stream (b"" when it closed first)."""


class HandOver(Protocol):
    """``Feature.HANDOVER``: the node hands the connection to a session worker process."""

    def handover_socket(self) -> socket.socket | None:
        """The socket a session worker process can serve this connection from, or None now."""

    def handover_factory(self) -> tuple[Any, dict[str, Any]]:
        """``(make, kwargs)``: the worker rebuilds the channel as ``make(sock, peer, **kwargs)``."""


class RelayStream(Protocol):
    """``Feature.RELAY``: what the node needs to relay a TLS session's plaintext to a worker."""

    def recv_some(self, view: memoryview) -> int:
        """At least one and at most ``view.nbytes`` bytes into ``view``; 0 once the peer closed."""

    def fileno(self) -> int:
        """The descriptor to poll for readiness (-1 once closed); never read it directly."""


class Layered(Protocol):
    """``Feature.LAYERED``: a channel over another one (the node finds a TLS stream underneath)."""

    @property
    def inner(self) -> Channel:
        """The channel underneath."""


class PreauthLimits(Protocol):
    """``Feature.PREAUTH_LIMITS`` (listeners): the node's pre-authentication caps."""

    def set_limits(self, *, per_source: int, total: int) -> None:
        """Cap connections still in their handshake: per source address and in all."""


def protocols() -> Mapping[Feature, type]:
    """Each feature's Protocol class (the conformance suite reads their members from these)."""
    return {Feature.BULK: BulkChannel, Feature.HANDSHAKE: HandshakeAware, Feature.UPGRADE_GATE: UpgradeGate,
            Feature.NATIVE_STREAM: NativeStream, Feature.NATIVE_RECORDS: NativeRecords, Feature.TLS: TlsUpgradable,
            Feature.PEEK: Peekable, Feature.HANDOVER: HandOver, Feature.RELAY: RelayStream, Feature.LAYERED: Layered,
            Feature.PREAUTH_LIMITS: PreauthLimits}


def handshake_aware(channel: object) -> HandshakeAware | None:
    """``channel`` as a :class:`HandshakeAware`, or None where it does not declare it."""
    return cast(HandshakeAware, channel) if offers(channel, Feature.HANDSHAKE) else None


def allow_upgrade(channel: object) -> None:
    """Server side, after WELCOME went out: let a channel with an :class:`UpgradeGate` serve its upgrade."""
    if offers(channel, Feature.UPGRADE_GATE):
        cast(UpgradeGate, channel).allow_upgrade()


def native_stream_of(channel: object) -> NativeStream | None:
    """``channel`` as a :class:`NativeStream`, or None where it does not declare it."""
    return cast(NativeStream, channel) if offers(channel, Feature.NATIVE_STREAM) else None


def native_stream(channel: object) -> tuple[int, bool] | None:
    """The channel's native stream now (``NativeStream.native_stream()``), None where it offers none."""
    native = native_stream_of(channel)
    return native.native_stream() if native is not None else None


def native_records_of(channel: object) -> NativeRecords | None:
    """``channel`` as :class:`NativeRecords`, or None where it does not declare it."""
    return cast(NativeRecords, channel) if offers(channel, Feature.NATIVE_RECORDS) else None


def tls_of(channel: object) -> TlsUpgradable | None:
    """``channel`` as a :class:`TlsUpgradable`, or None where it cannot do TLS."""
    return cast(TlsUpgradable, channel) if offers(channel, Feature.TLS) else None


def peekable(channel: object) -> Peekable | None:
    """``channel`` as a :class:`Peekable`, or None where it does not declare it."""
    return cast(Peekable, channel) if offers(channel, Feature.PEEK) else None


def handover_of(channel: object) -> HandOver | None:
    """``channel`` as a :class:`HandOver`, or None where it cannot move to a worker at all."""
    return cast(HandOver, channel) if offers(channel, Feature.HANDOVER) else None


def relay_stream_of(channel: object) -> RelayStream | None:
    """``channel`` as a :class:`RelayStream`, or None where it does not declare it."""
    return cast(RelayStream, channel) if offers(channel, Feature.RELAY) else None


def inner_of(channel: object) -> Channel | None:
    """The channel under a :class:`Layered` one, or None."""
    return cast(Layered, channel).inner if offers(channel, Feature.LAYERED) else None


def preauth_limits_of(listener: object) -> PreauthLimits | None:
    """``listener`` as :class:`PreauthLimits`, or None where it does not declare them."""
    return cast(PreauthLimits, listener) if offers(listener, Feature.PREAUTH_LIMITS) else None
