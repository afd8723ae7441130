"""Optional channel features are declared and only declared ones are used (genie.transport.features).

Real loopback TCP channels throughout; the few classes defined here subclass the real TcpChannel
to change only its declaration, which is the behaviour under test.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from genie.errors import HandshakeError, PluginError
from genie.transport.base import StreamBulk, bulk_path, handshake_complete
from genie.transport.feature_conformance import check_declared_members, held_pair
from genie.transport.features import Feature, declared, native_stream, protocols, tls_of
from genie.transport.stream import TcpChannel, TcpListener, connect_stream
from genie.wire.handshake import secure_client_channel


@pytest.fixture
def tcp_pair() -> Iterator[tuple[TcpChannel, TcpChannel]]:
    listener = TcpListener("127.0.0.1", 0)
    client = connect_stream("127.0.0.1", listener.port, timeout=5)
    with held_pair(client, listener.accept(timeout=5), listener) as pair:
        yield pair


class TcpWithoutTls(TcpChannel):
    """A TcpChannel whose class does not declare TLS (it still has the methods)."""

    features: ClassVar[frozenset[Feature]] = TcpChannel.features - {Feature.TLS}


class TcpTellsHandshake(TcpChannel):
    """A TcpChannel that declares HANDSHAKE and records the WELCOME it was given."""

    features: ClassVar[frozenset[Feature]] = TcpChannel.features | {Feature.HANDSHAKE}

    def __init__(self, sock: socket.socket, peer: str) -> None:
        super().__init__(sock, peer)
        self.welcomes: list[dict[str, Any]] = []

    def handshake_complete(self, welcome: dict[str, Any]) -> None:
        self.welcomes.append(welcome)


class TcpUndeclaredHandshake(TcpChannel):
    """Has a handshake_complete method but does not declare HANDSHAKE."""

    called = False

    def handshake_complete(self, welcome: dict[str, Any]) -> None:
        type(self).called = True


@pytest.fixture
def tcp_listener() -> Iterator[TcpListener]:
    listener = TcpListener("127.0.0.1", 0)
    try:
        yield listener
    finally:
        listener.close()


def _connect_as(cls: type[TcpChannel], listener: TcpListener) -> tuple[TcpChannel, TcpChannel]:
    """A client channel of class ``cls`` over a real connection to ``listener``, and the server's end."""
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
    return cls(sock, f"127.0.0.1:{listener.port}"), listener.accept(timeout=5)


def test_every_protocol_member_belongs_to_one_feature() -> None:
    from genie.transport.feature_conformance import members

    seen: dict[str, Feature] = {}
    for feature, protocol in protocols().items():
        assert feature.value == protocol.__name__
        for name in members(protocol):
            assert name not in seen, f"{name} is in both {seen[name]} and {feature}"
            seen[name] = feature
    assert set(protocols()) == set(Feature)


def test_the_in_tree_channels_declare_exactly_what_they_implement(tcp_pair: tuple[TcpChannel, TcpChannel]) -> None:
    from genie_dpdk.channel import DpdkChannel
    from genie_rdma.nixl_path import RdmaChannel
    from genie_shm.channel import ShmChannel

    client, server = tcp_pair
    assert check_declared_members(client) == [] and check_declared_members(server) == []
    assert check_declared_members(StreamBulk(client)) == []
    # The record backends over a real control stream (built, never upgraded; the pair's close ends them).
    for channel in (ShmChannel(client, server_side=False, ring_bytes=1 << 20), DpdkChannel(server, server_side=True),
                    RdmaChannel(client, None, server_side=False)):  # type: ignore[arg-type] # no NIXL agent needed
        assert check_declared_members(channel) == [], type(channel).__name__
        assert Feature.BULK in declared(channel) and bulk_path(channel) is channel


def test_an_undeclared_method_is_reported_and_never_called(tcp_listener: TcpListener) -> None:
    plain, server = _connect_as(TcpWithoutTls, tcp_listener)
    try:
        assert tls_of(plain) is None
        problems = check_declared_members(plain)
        assert any("start_tls exists but TcpWithoutTls does not declare Feature.TLS" in p for p in problems)
        with pytest.raises(HandshakeError, match="cannot do TLS"):
            secure_client_channel(plain, ssl.create_default_context(), server_hostname="127.0.0.1", where="test")
    finally:
        plain.close()
        server.close()


def test_handshake_complete_reaches_only_a_channel_that_declares_it(tcp_listener: TcpListener) -> None:
    told, told_server = _connect_as(TcpTellsHandshake, tcp_listener)
    untold, untold_server = _connect_as(TcpUndeclaredHandshake, tcp_listener)
    try:
        handshake_complete(told, {"node_id": "n"})
        handshake_complete(untold, {"node_id": "n"})
        assert isinstance(told, TcpTellsHandshake) and told.welcomes == [{"node_id": "n"}]
        assert not TcpUndeclaredHandshake.called
        assert any("handshake_complete exists but" in p for p in check_declared_members(untold))
    finally:
        for channel in (told, told_server, untold, untold_server):
            channel.close()


def test_a_malformed_declaration_is_a_plugin_error_naming_the_class() -> None:
    class Muddled:
        features = ("tls",)

    with pytest.raises(PluginError, match="Muddled.features must be a frozenset"):
        declared(Muddled())
    assert declared(object()) == frozenset()  # declaring nothing: nothing optional


def test_the_native_stream_is_the_sockets_and_gone_under_tls_or_close(tcp_pair: tuple[TcpChannel, TcpChannel]) -> None:
    client, _ = tcp_pair
    got = native_stream(client)
    assert got is not None and got[0] == client.fileno() and got[1] is False
    client.close()
    assert native_stream(client) is None
    assert native_stream(StreamBulk(client)) is None  # the stream bulk path declares no native stream


class TcpPeeksOddly(TcpChannel):
    """Declares PEEK (inherited) but takes another parameter than Peekable.peek's."""

    def peek(self, count: int, wait: bool = True) -> bytes:  # type: ignore[override]
        return super().peek(count)


def test_a_declared_member_with_other_parameters_is_reported(tcp_listener: TcpListener) -> None:
    odd, server = _connect_as(TcpPeeksOddly, tcp_listener)
    try:
        problems = check_declared_members(odd)
        assert len(problems) == 1 and "TcpPeeksOddly.peek(count: 'int', wait: 'bool' = True)" in problems[0]
        assert "Peekable.peek(self, nbytes: 'int')" in problems[0]
    finally:
        odd.close()
        server.close()
