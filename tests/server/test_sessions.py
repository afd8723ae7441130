"""Sessions, quotas and teardown, against an in-process DataPlaneServer on loopback."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from genie.errors import ConnectionClosedError
from genie.testing import wait_until
from genie.wire.frame import MsgKind
from tests.raw_client import H, RawClient, fetch, op, spec
from tests.raw_client import free as pack_free


def _wait_for(predicate, timeout: float = 5.0) -> None:
    wait_until(predicate, timeout, step=0.01, what="the server's session state")


def test_session_is_freed_when_the_client_disconnects(inproc_server):
    server = inproc_server()
    c = RawClient(server.port)
    c.handshake()
    c.send_batch([op("aten::add.Tensor", [H(1), H(1)], {}, [spec(2, torch.empty(256))])],
                 uploads=[(1, 0, torch.ones(256))])
    c.sync()
    stats = server.stats()
    assert stats["sessions"] == 1 and stats["handles"] == 2 and stats["bytes"] == 2048
    c.close()
    _wait_for(lambda: server.stats()["sessions"] == 0)
    assert server.stats()["handles"] == 0 and server.stats()["sessions_served"] == 1


def test_goodbye_frees_the_session(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([], uploads=[(1, 0, torch.ones(10))])
        c.sync()
        assert server.stats()["handles"] == 1
        c.goodbye()
        _wait_for(lambda: server.stats()["sessions"] == 0)


def test_free_releases_bytes_and_views_count_once(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        base = torch.zeros(100)
        c.send_batch([op("aten::slice.Tensor", [H(1), 0, 10, 20], {}, [spec(2, base[10:20])])],
                     uploads=[(1, 0, base)])
        c.sync()
        assert server.stats()["bytes"] == 400 and server.stats()["handles"] == 2
        c.send_batch([pack_free(1)])
        c.sync()
        assert server.stats()["bytes"] == 400 and server.stats()["handles"] == 1  # the view keeps the storage
        c.send_batch([pack_free(2)])
        c.sync()
        assert server.stats()["bytes"] == 0 and server.stats()["handles"] == 0


def test_handle_quota_refuses_with_a_clear_error(inproc_server):
    server = inproc_server(max_session_handles=3)
    with RawClient(server.port) as c:
        assert c.handshake()["limits"]["max_session_handles"] == 3
        c.send_batch([op("aten::neg", [H(1)], {}, [spec(2, torch.empty(1))]),
                      op("aten::neg", [H(1)], {}, [spec(3, torch.empty(1))]),
                      op("aten::neg", [H(1)], {}, [spec(4, torch.empty(1))])],
                     uploads=[(1, 0, torch.ones(1))])
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and err["handles"] == [4]
        assert "handle limit" in err["message"] and "max_session_handles" in err["message"]
        assert c.fetch(3).tolist() == [-1.0]


def test_byte_quota_on_uploads_and_op_outputs(inproc_server):
    server = inproc_server(max_session_bytes=1000)
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([], uploads=[(1, 0, torch.ones(200))])  # 800 bytes: fits
        c.send_batch([], uploads=[(2, 0, torch.ones(100))])  # 400 more: refused, stream stays in step
        r = c.sync()
        [err] = r.deferred
        assert err["kind"] == "quota" and err["op"] == "upload" and "memory limit" in err["message"]
        c.send_batch([op("aten::add.Tensor", [H(1), H(1)], {}, [spec(3, torch.empty(200))])])
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and err["handles"] == [3]
        c.send_batch([op("aten::zeros", [[1 << 30]], {}, [spec(4, torch.empty(1 << 30, device="meta"))])])
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and "would need" in err["message"]  # refused before allocating
        assert c.fetch(1).sum().item() == 200.0
        assert server.stats()["bytes"] == 800


def test_hello_must_arrive_in_time(inproc_server):
    server = inproc_server(hello_timeout=0.2)
    with RawClient(server.port) as c:  # says nothing: the server closes after hello_timeout
        with pytest.raises(ConnectionClosedError) as closed:
            c.recv()
    assert not isinstance(closed.value.__cause__, TimeoutError), "the server never closed: the client timed out"
    _wait_for(lambda: server.stats()["sessions"] == 0)


def test_auth_token_is_checked_by_challenge_never_accepted_in_plaintext(inproc_server):
    server = inproc_server(auth_token="s3cret")
    with RawClient(server.port) as c:
        kind, body = c.hello()
        assert kind == MsgKind.REJECT and body["code"] == "auth"
    with RawClient(server.port) as c:
        kind, body = c.hello(token="s3cret")  # the old plaintext field opens nothing
        assert kind == MsgKind.REJECT and body["code"] == "auth"
    with RawClient(server.port) as c:
        assert c.handshake(token=b"s3cret")["node_id"] == server.node_id


def test_sessions_are_isolated_and_run_concurrently(inproc_server):
    server = inproc_server()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with RawClient(server.port) as c:
                c.handshake()
                for i in range(20):
                    x = torch.full((64,), float(k * 100 + i))
                    c.send_batch([op("aten::mul.Scalar", [H(1), 2.0], {}, [spec(2, x)])], uploads=[(1, k % 2, x)])
                    assert c.fetch(2).tolist() == (x * 2).tolist()
                    c.send_batch([pack_free(1, 2)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    _wait_for(lambda: server.stats()["sessions"] == 0)


def test_stop_closes_every_session_and_joins_threads(inproc_server):
    server = inproc_server()
    clients = [RawClient(server.port) for _ in range(3)]
    try:
        for c in clients:
            c.handshake()
            c.send_batch([], uploads=[(1, 0, torch.ones(4))])
            c.sync()
        assert server.stats()["sessions"] == 3
        start = time.monotonic()
        server.stop(timeout=5)
        assert time.monotonic() - start < 3
        assert server.stats()["sessions"] == 0
        assert not [t for t in threading.enumerate() if t.name.startswith("genie-session")]
        for c in clients:
            with pytest.raises(ConnectionClosedError):
                c.recv()
    finally:
        for c in clients:
            c.close()


def test_fetch_of_a_poisoned_tensor_does_not_break_the_next_request(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([op("aten::mm", [H(1), H(1)], {}, [spec(2, torch.empty(2, 2))])],
                     uploads=[(1, 0, torch.ones(2, 3))])
        assert c.request([fetch(c.next_req(), 2)]).error is not None
        assert c.fetch(1).shape == (2, 3)


def test_in_place_resize_is_accounted_and_zeroed(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([op("aten::resize_", [H(1), [1000]], {}, [spec(2, torch.empty(1000))])],
                     uploads=[(1, 0, torch.ones(10))])
        assert c.sync().deferred == []
        assert server.stats()["bytes"] == 4000
        grown = c.fetch(1)
        assert grown[:10].tolist() == [1.0] * 10 and grown[10:].abs().sum() == 0  # no stale memory
