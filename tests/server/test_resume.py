"""A session survives a dropped link: resumed on a new connection, nothing lost, nothing run twice.

A real node (DataPlaneServer with process isolation: each session in its own worker process) behind
genie.testing's LinkEmulator, and a client written on the wire (genie.wire.resume's protocol) so each
test pins what the node does: the count of batches it received, the reply it sends again, the
refusals. The node has a cluster token, so every resume also passes the HMAC handshake.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from genie_tcp import TcpTransport

from genie.config import ClusterConfig
from genie.errors import AuthenticationError, RemoteDeviceLost
from genie.server import DataPlaneServer
from genie.testing import LinkEmulator, wait_until
from genie.wire.frame import MsgKind, pack_body, recv_header_and_body, recv_payload, send_frame, unpack_body
from genie.wire.handshake import client_handshake
from genie.wire.messages import hello_body
from tests.raw_client import Reply, T, call, fetch, op, sync

TOKEN = b"resume-test-token"
WINDOW = 2.0
X = torch.zeros(4)


@pytest.fixture(scope="module")
def node() -> Iterator[DataPlaneServer]:
    server = DataPlaneServer(TcpTransport(), "127.0.0.1", 0, [torch.device("cpu")],
                             ClusterConfig.from_sources({}, auth_token=TOKEN.decode(), reconnect_window=WINDOW),
                             hello_timeout=5.0)
    server.start()
    try:
        yield server
    finally:
        server.stop(timeout=5)


@pytest.fixture
def link(node: DataPlaneServer) -> Iterator[LinkEmulator]:
    with LinkEmulator(("127.0.0.1", node.port), delay=0.05) as emulator:  # 100 ms round trips: batches in flight
        yield emulator


class Client:
    """A client on the wire that numbers its batches and keeps them until a reply acknowledges them."""

    def __init__(self, port: int, node_id: str = "resume-test") -> None:
        self.port, self.node_id = port, node_id
        self.sent = 0
        self.kept: list[tuple[int, bytes, bytes]] = []
        self.attempts = 0
        self.reqs = iter(range(1, 1 << 30))
        self.channel = TcpTransport().connect("127.0.0.1", port, timeout=5)
        self.channel.settimeout(30)  # a fresh worker's first op waits for its warm-up (seconds on a busy host)
        welcome = client_handshake(self.channel, self.hello(), token=TOKEN, where="the test node")
        self.offer: dict[str, Any] = welcome["resume"]

    def hello(self, node_id: str | None = None) -> dict[str, Any]:
        return {**hello_body(node_id=node_id or self.node_id, role="client", backends=["tcp"]), "resumable": True}

    def batch(self, cmds: list[bytes], uploads: list[tuple[int, torch.Tensor]] = ()) -> None:  # type: ignore[assignment]
        ups = [[sid, 0, t.numel() * t.element_size()] for sid, t in uploads]
        body = pack_body({"uploads": ups, "cmds": cmds})
        payload = b"".join(t.contiguous().numpy().tobytes() for _, t in uploads)
        self.sent += 1
        self.kept.append((self.sent, body, payload))  # kept whole: sent again after a resume
        send_frame(self.channel, MsgKind.BATCH, body, [payload] if payload else [])

    def reply(self) -> Reply:
        header, raw = recv_header_and_body(self.channel)
        payload = bytearray(header.payload_len)
        if header.payload_len:
            recv_payload(self.channel, header.payload_len, [memoryview(payload)])
        assert header.kind == MsgKind.REPLY, (header.kind, unpack_body(raw))
        self.kept.clear()  # a reply acknowledges every batch sent before it
        return Reply(unpack_body(raw), bytes(payload))

    def request(self, cmds: list[bytes]) -> Reply:
        self.batch(cmds)
        return self.reply()

    def resume(self, *, awaiting: bool = False, attempt: int | None = None, secret: bytes | None = None,
               node_id: str | None = None, token: bytes = TOKEN) -> dict[str, Any]:
        """Reconnect and resume; sends again what the node lacks. Returns WELCOME's ``resumed``."""
        self.channel.close()
        self.attempts = attempt if attempt is not None else self.attempts + 1
        channel = TcpTransport().connect("127.0.0.1", self.port, timeout=5)
        channel.settimeout(30)
        welcome = client_handshake(channel, self.hello(node_id), token=token, where="the test node",
                                   resume={"session": self.offer["session"], "attempt": self.attempts,
                                           "sent": self.sent, "await": awaiting,
                                           "secret": secret if secret is not None else self.offer["secret"]})
        self.channel = channel
        resumed: dict[str, Any] = welcome["resumed"]
        for seq, body, payload in self.kept:
            if seq > resumed["batches"]:
                send_frame(channel, MsgKind.BATCH, body, [payload] if payload else [])
        return resumed

    def value(self) -> torch.Tensor:
        r = self.request([fetch(next(self.reqs), T(1, X).value)])
        assert r.error is None, r.error
        return torch.frombuffer(bytearray(r.payload), dtype=torch.float32).clone()

    def close(self) -> None:
        self.channel.close()


def session_stats(node: DataPlaneServer, client: Client) -> dict[str, Any]:
    return node.stats()["per_session"][client.offer["session"]]


def add_one() -> bytes:
    return op("aten::add_.Tensor", [T(1, X), 1.0], outs=[T(1, X).value])


def test_the_node_offers_resume_with_a_secret_it_never_sends_when_it_has_a_token(link: LinkEmulator) -> None:
    client = Client(link.port)
    try:
        assert client.offer["window"] == WINDOW and isinstance(client.offer["session"], int)
        assert len(client.offer["secret"]) == 32  # derived from the handshake on both ends, not from the wire
    finally:
        client.close()


def test_a_cut_mid_stream_loses_no_batch_and_runs_none_twice(node: DataPlaneServer, link: LinkEmulator) -> None:
    client = Client(link.port)
    try:
        client.batch([], uploads=[(1, X)])
        for _ in range(20):
            client.batch([add_one()])
        wait_until(lambda: session_stats(node, client)["batches"] == 21, 60)  # the first op waits for the warm-up
        for _ in range(20):  # in flight when the link drops: the emulator holds each for 50 ms
            client.batch([add_one()])
        assert link.cut() == 1
        resumed = client.resume()
        assert 21 <= resumed["batches"] < 41, resumed  # some were lost in the cut and are sent again
        assert torch.equal(client.value(), torch.full((4,), 40.0))  # each add ran exactly once
        stats = session_stats(node, client)
        assert stats["batches"] == client.sent == 42 and stats["resumes"] == 1, stats
    finally:
        client.close()


@pytest.mark.parametrize("request_kind", ["fetch", "item"])
def test_a_reply_lost_in_the_cut_is_sent_again_not_run_again(node: DataPlaneServer, link: LinkEmulator,
                                                             request_kind: str) -> None:
    client = Client(link.port)
    try:
        client.batch([], uploads=[(1, X)])

        def ask() -> bytes:
            if request_kind == "fetch":
                return fetch(next(client.reqs), T(1, X).value)
            return call(next(client.reqs), "aten::_local_scalar_dense", [T(1, X[0])])  # as .item() asks

        for _ in range(3):  # the same request again: the node runs it by a plan (natively where it can)
            assert client.request([add_one(), ask()]).error is None
        client.batch([add_one(), ask()])
        wait_until(lambda: session_stats(node, client)["batches"] == client.sent, 60)
        link.cut()  # the reply is on its way (the emulator holds it for 50 ms) or not yet sent
        resumed = client.resume(awaiting=True)
        assert resumed == {"batches": client.sent, "replay": True}
        r = client.reply()
        assert r.error is None, r.error
        got = torch.frombuffer(bytearray(r.payload), dtype=torch.float32)[0].item() if request_kind == "fetch" \
            else r.result
        assert got == 4.0  # the reply of the fourth add: it ran once, and was not run again for the resend
        assert torch.equal(client.value(), torch.full((4,), 4.0))
    finally:
        client.close()


def test_an_outage_longer_than_the_window_loses_the_session_and_says_so(node: DataPlaneServer,
                                                                          link: LinkEmulator) -> None:
    client = Client(link.port)
    try:
        client.batch([], uploads=[(1, X)])
        assert client.request([sync(next(client.reqs))]).error is None
        session = client.offer["session"]
        link.down()
        wait_until(lambda: session not in node.stats()["per_session"], WINDOW + 10)  # the worker is gone
        link.up()
        with pytest.raises(RemoteDeviceLost, match=r"refused to resume the session: no session \d+ to resume.*"
                                                   r"reconnect window passed"):
            client.resume()
    finally:
        client.close()


class _NoConnection:
    def close(self) -> None:
        pass


def impostor(client: Client) -> Client:
    """Someone who learnt everything ``client`` knows (its session, attempts, secret) but is not connected."""
    other = Client.__new__(Client)
    other.__dict__.update(client.__dict__, kept=[], channel=_NoConnection())
    return other


@pytest.fixture(scope="module")
def pair(node: DataPlaneServer) -> Iterator[tuple[Client, Client, LinkEmulator]]:
    """A session behind a link and a bystander's session on the same node, each warmed up."""
    with LinkEmulator(("127.0.0.1", node.port), delay=0.05) as link:
        client, bystander = Client(link.port), Client(node.port, node_id="bystander")
        try:
            for c in (client, bystander):
                c.batch([], uploads=[(1, X)])
                assert torch.equal(c.value(), X)  # each worker's first op (its warm-up) paid once here
            yield client, bystander, link
        finally:
            client.close()
            bystander.close()


class TestRefusedResumes:
    """Tokens that must not resume a session; the session itself, and a bystander's, go on."""

    @pytest.fixture
    def both(self, pair: tuple[Client, Client, LinkEmulator]) -> Iterator[tuple[Client, LinkEmulator]]:
        client, bystander, link = pair
        yield client, link
        for c in (client, bystander):  # both still work, their tensors intact
            before = c.value()
            c.batch([add_one()])
            assert torch.equal(c.value(), before + 1)

    def test_a_replayed_resume_token_is_refused(self, both: tuple[Client, LinkEmulator]) -> None:
        client, link = both
        link.cut()
        client.resume()
        thief = impostor(client)  # it saw the resume: the same attempt, with a valid proof for its own HELLO
        with pytest.raises(RemoteDeviceLost, match=r"attempt \d+ of session \d+ was used already"):
            thief.resume(attempt=client.attempts)

    def test_a_forged_resume_token_is_refused(self, both: tuple[Client, LinkEmulator]) -> None:
        client, _ = both
        forger = impostor(client)
        with pytest.raises(RemoteDeviceLost, match=r"invalid resume token for session \d+"):
            forger.resume(secret=bytes(32))

    def test_a_resume_token_from_another_identity_is_refused(self, both: tuple[Client, LinkEmulator]) -> None:
        client, _ = both
        other = impostor(client)
        with pytest.raises(RemoteDeviceLost, match="belongs to another client identity"):
            other.resume(node_id="someone-else")

    def test_a_resume_without_the_cluster_token_is_refused(self, both: tuple[Client, LinkEmulator]) -> None:
        client, _ = both
        other = impostor(client)
        with pytest.raises(AuthenticationError):
            other.resume(token=b"not-the-cluster-token")
