"""Sessions, quotas and teardown, against an in-process DataPlaneServer on loopback."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from genie.errors import ConnectionClosedError
from genie.testing import wait_until
from genie.wire.frame import MsgKind
from tests.raw_client import RawClient, T, desc, fetch, op, resize
from tests.raw_client import free as pack_free


def _wait_for(predicate, timeout: float = 5.0) -> None:
    wait_until(predicate, timeout, step=0.01, what="the server's session state")


def test_session_is_freed_when_the_client_disconnects(inproc_server):
    server = inproc_server()
    c = RawClient(server.port)
    c.handshake()
    x = torch.ones(256)
    c.send_batch([op("aten::add.Tensor", [T(1, x), T(1, x)], {}, [desc(2, x)])], uploads=[(1, 0, x)])
    c.sync()
    stats = server.stats()
    assert stats["sessions"] == 1 and stats["storages"] == 2 and stats["bytes"] == 2048
    c.close()
    _wait_for(lambda: server.stats()["sessions"] == 0)
    assert server.stats()["storages"] == 0 and server.stats()["sessions_served"] == 1


def test_goodbye_frees_the_session(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([], uploads=[(1, 0, torch.ones(10))])
        c.sync()
        assert server.stats()["storages"] == 1
        c.goodbye()
        _wait_for(lambda: server.stats()["sessions"] == 0)


def test_views_cost_nothing_and_free_releases_the_storage(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        base = torch.zeros(100)
        c.send_batch([op("aten::add_.Scalar", [T(1, base[10:20]), 1.0], {}, [desc(1, base[10:20])])],
                     uploads=[(1, 0, base)])
        c.sync()
        assert server.stats()["bytes"] == 400 and server.stats()["storages"] == 1
        assert c.fetch(1, base).sum().item() == 10.0
        c.send_batch([pack_free(1)])
        c.sync()
        assert server.stats()["bytes"] == 0 and server.stats()["storages"] == 0


def test_storage_quota_refuses_with_a_clear_error(inproc_server):
    server = inproc_server(max_session_handles=3)
    one = torch.ones(1)
    with RawClient(server.port) as c:
        assert c.handshake()["limits"]["max_session_handles"] == 3
        c.send_batch([op("aten::neg", [T(1, one)], {}, [desc(2, one)]),
                      op("aten::neg", [T(1, one)], {}, [desc(3, one)]),
                      op("aten::neg", [T(1, one)], {}, [desc(4, one)])],
                     uploads=[(1, 0, one)])
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and err["storages"] == [4]
        assert "storage limit" in err["message"] and "max_session_handles" in err["message"]
        assert c.fetch(3, one).tolist() == [-1.0]


def test_byte_quota_on_uploads_op_outputs_unseen_storages_and_resizes(inproc_server):
    server = inproc_server(max_session_bytes=1000)
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([], uploads=[(1, 0, torch.ones(200))])  # 800 bytes: fits
        c.send_batch([], uploads=[(2, 0, torch.ones(100))])  # 400 more: refused, stream stays in step
        r = c.sync()
        [err] = r.deferred
        assert err["kind"] == "quota" and err["op"] == "upload" and "memory limit" in err["message"]
        x = torch.empty(200)
        c.send_batch([op("aten::add.Tensor", [T(1, x), T(1, x)], {}, [desc(3, x)])])
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and err["storages"] == [3]
        huge = torch.empty(1 << 30, device="meta")
        c.send_batch([op("aten::zeros", [[1 << 30]], {}, [desc(4, huge)])])
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and "would need" in err["message"]  # refused before allocating
        c.send_batch([op("aten::add_.Scalar", [T(5, x), 1.0], {}, [desc(5, x)])])  # an unseen 800-byte storage
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and "max_session_bytes" in err["message"]
        c.send_batch([resize(0, 1, 4000)])
        [err] = c.sync().deferred
        assert err["kind"] == "quota" and err["op"] == "resize"
        assert server.stats()["bytes"] == 0  # the refused resize poisoned storage 1
        c.send_batch([], uploads=[(6, 0, torch.ones(250))])
        assert c.fetch(6, torch.empty(250)).sum().item() == 250.0
        assert server.stats()["bytes"] == 1000


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
            # Four sessions open at once: all but the node's spare worker start cold (each imports torch), which
            # took over 10 s on a loaded 2-core machine; a bound for that, not a speed check.
            with RawClient(server.port, timeout=30.0) as c:
                c.handshake()
                for i in range(20):
                    x = torch.full((64,), float(k * 100 + i))
                    ids = (2 * i + 1, 2 * i + 2)  # storage ids are never reused
                    c.send_batch([op("aten::mul.Scalar", [T(ids[0], x), 2.0], {}, [desc(ids[1], x)], device=k % 2)],
                                 uploads=[(ids[0], k % 2, x)])
                    assert c.fetch(ids[1], x, device=k % 2).tolist() == (x * 2).tolist()
                    c.send_batch([pack_free(*ids)])
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


def test_fetch_of_a_poisoned_storage_does_not_break_the_next_request(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        a = torch.ones(2, 3)
        c.send_batch([op("aten::mm", [T(1, a), T(1, a)], {}, [desc(2, torch.empty(2, 2))])], uploads=[(1, 0, a)])
        assert c.request([fetch(c.next_req(), desc(2, torch.empty(2, 2)))]).error is not None
        assert c.fetch(1, a).shape == (2, 3)


def test_in_place_resize_op_is_accounted_and_zeroed(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        ten = torch.ones(10)
        c.send_batch([op("aten::resize_", [T(1, ten), [1000]], {}, [desc(1, torch.empty(1000))])],
                     uploads=[(1, 0, ten)])
        assert c.sync().deferred == []
        assert server.stats()["bytes"] == 4000
        grown = c.fetch(1, torch.empty(1000))
        assert grown[:10].tolist() == [1.0] * 10 and grown[10:].abs().sum() == 0  # no stale memory


def test_resize_command_keeps_the_prefix_zeroes_the_rest_and_shrinks(inproc_server):
    server = inproc_server()
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([resize(0, 1, 64)], uploads=[(1, 0, torch.arange(4.0))])
        grown = c.fetch(1, torch.empty(16))
        assert grown[:4].tolist() == [0.0, 1.0, 2.0, 3.0] and grown[4:].abs().sum() == 0
        assert server.stats()["bytes"] == 64
        c.send_batch([resize(0, 1, 8)])
        assert c.fetch(1, torch.empty(2)).tolist() == [0.0, 1.0] and server.stats()["bytes"] == 8
        r = c.request([fetch(c.next_req(), desc(1, torch.empty(16)))])  # the old size is gone
        assert r.error["kind"] == "storage" and "CMD_RESIZE" in r.error["message"]
        c.send_batch([resize(0, 2, 12)])  # an unseen storage is made at the new size, zeroed
        assert c.fetch(2, torch.empty(3)).tolist() == [0.0, 0.0, 0.0]
