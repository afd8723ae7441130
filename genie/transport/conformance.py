"""The transport conformance suite: what every backend's channels and listeners must do.

A backend runs it by subclassing in one of its test modules::

    from genie.transport.conformance import TransportConformance
    from genie_x import XTransport

    class TestXConformance(TransportConformance):
        transport_class = XTransport

pytest then runs every ``test_*`` below against real channels of that backend
(a listener on ``host`` and a connected pair; both ends in the test process, on
separate threads where a test needs both at once). Class attributes adapt it:

- ``host``: where to listen and connect (``"127.0.0.1"``; a backend tested across
  network namespaces overrides it and :meth:`TransportConformance.make_pair`).
- ``complete_handshake``: tell the client's channel its handshake is done right
  after connecting (what genie's client does after WELCOME), so backends that
  move to another path then (shm's rings) are tested on it. ``False`` tests the
  path before the handshake.
- ``bulk_bytes``: the size of the large transfers (default 16 MiB).

The suite checks behaviour only through the public interface
(:mod:`genie.transport.base`): ordering and exact fills across mismatched
boundaries, scatter/gather beyond IOV_MAX, full-duplex bulk, the bulk path,
timeouts, a dead peer, close from another thread, use after close, refused
connects and listener timeouts; and, for every optional feature (:mod:`genie.transport.features`),
that the channels and listener implement each one their class declares, with its Protocol's
signatures, in a round trip, and none they do not declare
(:class:`~genie.transport.feature_conformance.FeatureConformance`). Every thread it starts is
joined with a bound and every channel closed, even when a test fails.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import ClassVar

import pytest

from genie.errors import ConnectError, ConnectionClosedError, TransportError
from genie.transport.base import (
    BulkChannel,
    Channel,
    Listener,
    ProbeTarget,
    Transport,
    bulk_path,
    capabilities_of,
    handshake_complete,
)
from genie.transport.feature_conformance import FeatureConformance, Worker, held_pair, recv_exact
from genie.transport.features import allow_upgrade
from genie.types import ProbeResult


def _pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _closed_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TransportConformance(FeatureConformance):
    """Subclass as ``Test<Backend>Conformance`` and set ``transport_class``; see the module docstring."""

    transport_class: ClassVar[type[Transport]]
    host: ClassVar[str] = "127.0.0.1"
    complete_handshake: ClassVar[bool] = True
    bulk_bytes: ClassVar[int] = 16 << 20
    timeout: ClassVar[float] = 20.0

    # -- fixtures ----------------------------------------------------------------------------
    def connect_pair(self) -> tuple[Channel, Channel, Listener]:
        """A listener and a connected (client, server) pair, nothing sent on it yet (no handshake)."""
        transport = self.transport_class()
        listener = transport.listen(self.host, 0)
        try:
            client = transport.connect(self.host, listener.port, timeout=self.timeout)
            server = listener.accept(timeout=self.timeout)
        except BaseException:
            listener.close()
            raise
        for channel in (client, server):
            channel.settimeout(self.timeout)
        return client, server, listener

    def make_pair(self) -> tuple[Channel, Channel, Listener]:
        """A listener and a connected (client, server) pair, the client told its handshake is done."""
        client, server, listener = self.connect_pair()
        if self.complete_handshake:
            # The server must be reading while the client finishes (a backend may switch paths then).
            marker = Worker(lambda: recv_exact(server, 1))
            allow_upgrade(server)  # the server sent WELCOME: a record backend may upgrade now
            try:
                handshake_complete(client, {})
                client.sendv([b"!"])
                assert marker.outcome() == b"!"
            except BaseException:
                client.close()
                server.close()
                listener.close()
                raise
        return client, server, listener

    @pytest.fixture
    def pair(self) -> Iterator[tuple[Channel, Channel]]:
        with held_pair(*self.make_pair()) as pair:
            yield pair

    @pytest.fixture
    def listener(self) -> Iterator[Listener]:
        listener = self.transport_class().listen(self.host, 0)
        try:
            yield listener
        finally:
            listener.close()

    # -- the interface -----------------------------------------------------------------------
    def test_channels_and_listener_satisfy_the_protocols(self, pair: tuple[Channel, Channel],
                                                         listener: Listener) -> None:
        client, server = pair
        assert isinstance(client, Channel) and isinstance(server, Channel)
        assert isinstance(listener, Listener) and listener.port > 0
        assert isinstance(bulk_path(client), BulkChannel)
        assert isinstance(client.peer, str) and client.peer

    def test_transport_names_itself_and_probes_locally(self) -> None:
        import anyio

        cls = self.transport_class
        assert isinstance(cls.name, str) and cls.name
        result = anyio.run(cls().probe, ProbeTarget())
        assert isinstance(result, ProbeResult) and result.name == cls.name

    # -- the stream --------------------------------------------------------------------------
    def test_sendv_keeps_order_and_recv_into_fills_across_other_boundaries(
            self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        parts: list[bytes | bytearray | memoryview] = [
            b"a", _pattern(1000, 1), b"", bytearray(_pattern(70_000, 2)), memoryview(_pattern(5, 3))]
        whole = b"".join(bytes(p) for p in parts)
        client.sendv(parts)
        got = recv_exact(server, 7) + recv_exact(server, len(whole) - 8) + recv_exact(server, 1)
        assert got == whole

    def test_both_directions_and_empty_sends(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        client.sendv([])
        client.sendv([b""])
        client.sendv([b"ping"])
        assert recv_exact(server, 4) == b"ping"
        server.sendv([b"pong"])
        assert recv_exact(client, 4) == b"pong"

    def test_more_buffers_than_iov_max(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        parts = [bytes([i % 251]) * (1 + i % 7) for i in range(3000)]
        whole = b"".join(parts)
        reader = Worker(lambda: recv_exact(server, len(whole)))
        client.sendv(parts)
        assert reader.outcome() == whole

    def test_bulk_full_duplex_every_byte_right(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        up, down = _pattern(self.bulk_bytes, 4), _pattern(self.bulk_bytes + 12345, 5)
        server_reads = Worker(lambda: recv_exact(server, len(up)))
        server_sends = Worker(lambda: server.sendv([down]))
        client_reads = Worker(lambda: recv_exact(client, len(down)))
        client.sendv([up])
        server_sends.outcome()
        assert server_reads.outcome() == up
        assert client_reads.outcome() == down

    def test_mixed_sizes_in_many_frames(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        rng = random.Random(6)
        frames = [[_pattern(rng.choice([0, 1, 24, 900, 70_000, 300_000]), rng.randrange(1 << 30))
                   for _ in range(rng.randrange(1, 4))] for _ in range(60)]
        expected = b"".join(b"".join(f) for f in frames)
        reader = Worker(lambda: b"".join(recv_exact(server, n) for n in _cuts(len(expected), rng.randrange(1 << 30))))
        for frame in frames:
            client.sendv(frame)
        assert reader.outcome() == expected

    # -- the bulk path ------------------------------------------------------------------------
    def test_bulk_path_sends_and_receives_regions(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        sender, receiver = bulk_path(client), bulk_path(server)
        assert capabilities_of(client).backend
        source = bytearray(_pattern(1 << 20, 7))
        target = bytearray(1 << 20)
        out, into = sender.register(source), receiver.register(target)
        try:
            reader = Worker(lambda: receiver.recv_region(into, 4096, 65536))
            sender.send_region(out, 1000, 65536)
            reader.outcome()
            assert bytes(target[4096:4096 + 65536]) == bytes(source[1000:1000 + 65536])
            reader = Worker(lambda: receiver.recv_region(into))
            sender.send_region(out)
            reader.outcome()
            assert target == source
            with pytest.raises(ValueError, match="outside"):
                sender.send_region(out, 1 << 20, 1)
        finally:
            sender.deregister(out)
            receiver.deregister(into)

    def test_bulk_path_lands_a_tensor_in_a_preallocated_tensor(self, pair: tuple[Channel, Channel]) -> None:
        torch = pytest.importorskip("torch")
        client, server = pair
        source = torch.arange(1 << 20, dtype=torch.float32)
        target = torch.empty_like(source)
        sender, receiver = bulk_path(client), bulk_path(server)
        out, into = sender.register(source), receiver.register(target)
        reader = Worker(lambda: receiver.recv_region(into))
        sender.send_region(out)
        reader.outcome()
        assert torch.equal(source, target)

    # -- failures ----------------------------------------------------------------------------
    def test_peer_closing_mid_receive_raises_connection_closed(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        client.sendv([b"half"])
        client.close()
        with pytest.raises(ConnectionClosedError):
            recv_exact(server, 8)

    def test_receive_timeout_raises_connection_closed_and_closes(self, pair: tuple[Channel, Channel]) -> None:
        _, server = pair
        server.settimeout(0.2)
        with pytest.raises(ConnectionClosedError, match="timed out"):
            recv_exact(server, 1)
        with pytest.raises(ConnectionClosedError):
            server.sendv([b"x"])

    def test_close_from_another_thread_wakes_a_blocked_receiver(self, pair: tuple[Channel, Channel]) -> None:
        _, server = pair
        server.settimeout(None)
        blocked = Worker(lambda: recv_exact(server, 1))
        blocked.join(0.2)
        server.close()
        with pytest.raises(ConnectionClosedError):
            blocked.outcome(10)

    def test_send_to_a_dead_peer_raises_connection_closed(self, pair: tuple[Channel, Channel]) -> None:
        client, server = pair
        server.close()
        with pytest.raises(ConnectionClosedError):
            for _ in range(64):  # buffers in between may take the first sends
                client.sendv([bytes(1 << 20)])

    def test_use_after_close_and_close_twice(self, pair: tuple[Channel, Channel]) -> None:
        client, _ = pair
        client.close()
        client.close()
        with pytest.raises(ConnectionClosedError):
            client.sendv([b"x"])
        with pytest.raises(ConnectionClosedError):
            recv_exact(client, 1)

    def test_connect_to_a_closed_port_raises_connect_error(self) -> None:
        with pytest.raises(TransportError) as info:
            self.transport_class().connect(self.host, _closed_port(self.host), timeout=5)
        assert isinstance(info.value, ConnectError)

    def test_accept_timeout_and_closed_listener(self, listener: Listener) -> None:
        with pytest.raises(TimeoutError):
            listener.accept(timeout=0.1)
        listener.close()
        with pytest.raises(ConnectionClosedError):
            listener.accept(timeout=0.1)

    def test_two_channels_on_one_listener_are_independent(self, listener: Listener) -> None:
        transport = self.transport_class()
        ends = []
        try:
            for _ in range(2):
                client = transport.connect(self.host, listener.port, timeout=self.timeout)
                ends.append(client)
                ends.append(listener.accept(timeout=self.timeout))
            for channel in ends:
                channel.settimeout(self.timeout)
            ends[0].sendv([b"one"])
            ends[2].sendv([b"two"])
            assert recv_exact(ends[3], 3) == b"two"
            assert recv_exact(ends[1], 3) == b"one"
        finally:
            for channel in ends:
                channel.close()


def _cuts(total: int, seed: int) -> list[int]:
    """Split ``total`` into receive sizes unrelated to the send boundaries."""
    rng = random.Random(seed)
    out = []
    while total:
        n = min(total, rng.choice([1, 9, 4096, 65_536, 200_000]))
        out.append(n)
        total -= n
    return out
