"""The TCP transport passes the transport conformance suite (real loopback sockets)."""

from __future__ import annotations

from genie_tcp import TcpTransport

from genie.transport.conformance import TransportConformance


class TestTcpConformance(TransportConformance):
    transport_class = TcpTransport
