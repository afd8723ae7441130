"""The conformance suite's checks of optional features (:mod:`genie.transport.features`).

:class:`~genie.transport.conformance.TransportConformance` inherits these, so every backend
that runs the suite runs them too. For the client and server channels of a pair and for the
listener they check:

- every feature the class declares has each member of its Protocol, with the Protocol's
  parameters (names, kinds, defaults), and works: a round trip through it on real channels
  (TLS on a fresh pair, a socket handed over and served by a rebuilt channel, genie._C's
  native stream read directly, ...);
- no member of a feature the class does not declare is there: the core never looks for
  undeclared methods, so one that exists undeclared is never used (a bug either way).

Features that need a stream nothing has crossed yet (TLS, peeking, the hand-over) are tried
on a fresh pair from :meth:`connect_pair`; the others on the suite's ``pair``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from genie.errors import ConnectionClosedError, TransportError
from genie.transport.base import Channel, Listener, Transport
from genie.transport.features import (
    Feature,
    declared,
    handover_of,
    inner_of,
    native_records_of,
    native_stream_of,
    peekable,
    preauth_limits_of,
    protocols,
    relay_stream_of,
    tls_of,
)

JOIN = 30.0  #: the longest a conformance test waits for its worker thread


def members(protocol: type) -> dict[str, Any]:
    """The members a feature's Protocol defines itself (methods and properties), by name."""
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def check_declared_members(obj: object) -> list[str]:
    """What is wrong with ``obj``'s declaration (empty when nothing is): declared members missing or with
    other parameters than their Protocol's, undeclared members present."""
    problems = []
    features = declared(obj)
    name = type(obj).__qualname__
    for feature, protocol in protocols().items():
        for member, spec in members(protocol).items():
            present = hasattr(obj, member)
            if feature not in features:
                if present:
                    problems.append(f"{name}.{member} exists but {name} does not declare {feature}")
                continue
            if not present:
                problems.append(f"{name} declares {feature} but has no {member}")
            elif inspect.isfunction(spec):
                impl = getattr(obj, member)
                want = _parameters(spec)[1:]  # the Protocol's function is unbound: drop self
                if not callable(impl):
                    problems.append(f"{name}.{member} must be a method ({feature})")
                elif _parameters(impl) != want:
                    problems.append(f"{name}.{member}{inspect.signature(impl)} does not take the parameters of "
                                    f"{protocol.__name__}.{member}{inspect.signature(spec)}")
            elif callable(getattr(obj, member)):
                problems.append(f"{name}.{member} must be an attribute or property, not a method ({feature})")
    return problems


class Worker(threading.Thread):
    """Runs ``fn`` on a thread and hands back its result or exception (joined with a bound): the conformance
    suites' other end of a channel."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def outcome(self, timeout: float = JOIN) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"worker thread still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


@contextlib.contextmanager
def held_pair(client: Any, server: Any, listener: Any) -> Iterator[tuple[Any, Any]]:
    """The connected pair for a test's body; the two ends and their listener closed after it, whatever happened."""
    try:
        yield client, server
    finally:
        client.close()
        server.close()
        listener.close()


def recv_exact(channel: Channel, n: int) -> bytes:
    buf = bytearray(n)
    channel.recv_into(memoryview(buf))
    return bytes(buf)


def _self_signed(directory: Path) -> tuple[str, str]:
    """A throwaway certificate and key for 127.0.0.1 (PEM paths)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "genie conformance")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


class FeatureConformance:
    """The optional-feature checks; see the module docstring. Mixed into TransportConformance."""

    transport_class: ClassVar[type[Transport]]
    timeout: ClassVar[float]

    def connect_pair(self) -> tuple[Channel, Channel, Listener]:  # pragma: no cover - TransportConformance's
        raise NotImplementedError

    @pytest.fixture
    def fresh_pair(self) -> Iterator[tuple[Channel, Channel]]:
        """A connected pair nothing has crossed yet (no handshake, no upgrade)."""
        with held_pair(*self.connect_pair()) as pair:
            yield pair

    def test_declared_features_are_there_with_their_signatures_and_nothing_undeclared(
            self, pair: tuple[Channel, Channel], listener: Listener) -> None:
        problems = [p for obj in (*pair, listener) for p in check_declared_members(obj)]
        assert not problems, "\n".join(problems)

    def test_native_stream_carries_the_channels_frames(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        native = native_stream_of(server)
        if native is None:
            pytest.skip(f"{type(server).__name__} does not declare {Feature.NATIVE_STREAM}")
        got = native.native_stream()
        if got is None:
            pytest.skip(f"{type(server).__name__} offers no native stream in this state (it may say None)")
        fd, records = got
        assert native.at_rest()
        client.sendv([b"native", b"!"])
        with socket.socket(fileno=os.dup(fd)) as raw:
            raw.settimeout(self.timeout)
            if records:
                from genie.transport.record import INLINE, RECORD

                head = raw.recv(RECORD.size, socket.MSG_WAITALL)
                assert RECORD.unpack(head) == (INLINE, 7)
            assert raw.recv(7, socket.MSG_WAITALL) == b"native!"
        assert native.at_rest()
        client.sendv([b"after"])  # the channel is still in step with the stream
        assert recv_exact(server, 5) == b"after"

    def test_native_records_take_back_what_the_native_reader_read(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        records = native_records_of(server)
        if records is None:
            pytest.skip(f"{type(server).__name__} does not declare {Feature.NATIVE_RECORDS}")
        records.unread(b"un")
        native = native_stream_of(server)
        assert native is None or not native.at_rest()  # bytes are kept on this side now
        client.sendv([b"read"])
        assert recv_exact(server, 6) == b"unread"
        got = native.native_stream() if native is not None else None
        if got is None or not got[1]:
            return  # resume_record needs a record stream genie._C can read
        from genie.transport.record import RECORD

        client.sendv([b"resumed"])
        with socket.socket(fileno=os.dup(got[0])) as raw:
            raw.settimeout(self.timeout)
            kind, length = RECORD.unpack(raw.recv(RECORD.size, socket.MSG_WAITALL))
            two = raw.recv(2, socket.MSG_WAITALL)
        records.resume_record(b"", kind, length)  # the header was read natively, then two bytes of the body
        records.unread(two)
        assert recv_exact(server, 7) == b"resumed"

    def test_tls_upgrades_the_stream(self, fresh_pair: tuple[Channel, Channel], tmp_path: Path) -> None:
        client, server = fresh_pair
        client_tls, server_tls = tls_of(client), tls_of(server)
        if client_tls is None or server_tls is None:
            assert client_tls is None and server_tls is None, "one end of a pair declares TLS, the other not"
            pytest.skip(f"{type(server).__name__} does not declare {Feature.TLS}")
        pytest.importorskip("cryptography")
        cert, key = _self_signed(tmp_path)
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(cert, key)
        client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client_ctx.load_verify_locations(cert)
        assert client_tls.tls_version is None and server_tls.tls_version is None
        accepting = Worker(lambda: server_tls.start_tls(server_ctx, server_side=True))
        client_tls.start_tls(client_ctx, server_side=False, server_hostname="127.0.0.1")
        accepting.outcome()
        assert client_tls.tls_version in ("TLSv1.2", "TLSv1.3") and server_tls.tls_version == client_tls.tls_version
        client.sendv([b"sealed"])
        assert recv_exact(server, 6) == b"sealed"
        server.sendv([b"back"])
        assert recv_exact(client, 4) == b"back"

    def test_peek_leaves_the_bytes_in_the_stream(self, fresh_pair: tuple[Channel, Channel]) -> None:
        client, server = fresh_pair
        peek = peekable(server)
        if peek is None:
            pytest.skip(f"{type(server).__name__} does not declare {Feature.PEEK}")
        client.sendv([b"look"])
        head = peek.peek(2)
        assert len(head) == 2  # the first bytes on the stream (a record backend's record header)
        assert peek.peek(2) == head
        assert recv_exact(server, 4) == b"look"

    def test_handover_rebuilds_the_server_channel_elsewhere(self, fresh_pair: tuple[Channel, Channel]) -> None:
        client, server = fresh_pair
        handover = handover_of(server)
        if handover is None:
            pytest.skip(f"{type(server).__name__} does not declare {Feature.HANDOVER}")
        sock = handover.handover_socket()
        assert sock is not None, "a fresh server channel must be able to move to a session worker"
        make, kwargs = handover.handover_factory()
        # What a worker gets: a duplicate descriptor (sent over a Unix socket), rebuilt into a channel.
        moved = make(socket.socket(fileno=os.dup(sock.fileno())), server.peer, **kwargs)
        try:
            assert declared(moved) == declared(server)
            moved.settimeout(self.timeout)
            client.sendv([b"moved"])
            assert recv_exact(moved, 5) == b"moved"
            moved.sendv([b"ok"])
            assert recv_exact(client, 2) == b"ok"
        finally:
            moved.close()

    def test_relay_stream_receives_what_has_arrived(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        relay = relay_stream_of(server)
        if relay is None:
            pytest.skip(f"{type(server).__name__} does not declare {Feature.RELAY}")
        assert relay.fileno() >= 0
        client.sendv([b"partial"])
        got = b""
        buf = bytearray(64)
        while len(got) < 7:
            n = relay.recv_some(memoryview(buf))
            assert 0 < n <= 7 - len(got)
            got += bytes(buf[:n])
        assert got == b"partial"
        client.close()
        assert relay.recv_some(memoryview(buf)) == 0  # the peer closed
        server.close()
        assert relay.fileno() == -1

    def test_a_layered_channel_names_the_channel_underneath(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        if inner_of(server) is None:
            pytest.skip(f"{type(server).__name__} does not declare {Feature.LAYERED}")
        for channel in (client, server):
            inner = inner_of(channel)
            assert isinstance(inner, Channel) and inner is not channel and inner.peer == channel.peer
        inner = inner_of(client)
        assert inner is not None
        client.close()
        with pytest.raises(ConnectionClosedError):  # closing the layered channel closed what is under it
            inner.sendv([b"x"])

    def test_preauth_limits_apply_to_the_listener(self, listener: Listener) -> None:
        limits = preauth_limits_of(listener)
        if limits is None:
            pytest.skip(f"{type(listener).__name__} does not declare {Feature.PREAUTH_LIMITS}")
        limits.set_limits(per_source=1, total=8)
        transport = self.transport_class()
        first = transport.connect(listener.host, listener.port, timeout=self.timeout)
        ends = [first]
        try:
            # The first connection is not accepted yet: a second from the same address is over the cap.
            with pytest.raises(TransportError):
                ends.append(transport.connect(listener.host, listener.port, timeout=self.timeout))
            ends.append(listener.accept(timeout=self.timeout))  # accepting it frees its place
            ends.append(transport.connect(listener.host, listener.port, timeout=self.timeout))
            ends.append(listener.accept(timeout=self.timeout))
            for end in ends:
                end.settimeout(self.timeout)
            ends[2].sendv([b"third"])
            assert recv_exact(ends[3], 5) == b"third"
        finally:
            for end in ends:
                end.close()
