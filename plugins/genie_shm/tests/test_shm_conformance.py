"""The shm transport passes the transport conformance suite, on its rings and before the hand-over."""

from __future__ import annotations

from genie_shm import ShmTransport

from genie.transport.conformance import TransportConformance


class TestShmConformance(TransportConformance):
    """After the handshake: records over the Unix socket, bulk bytes through the memfd rings."""

    transport_class = ShmTransport


class TestShmBeforeHandshakeConformance(TransportConformance):
    """Before the handshake: records on the TCP stream, no segment handed over yet."""

    transport_class = ShmTransport
    complete_handshake = False
