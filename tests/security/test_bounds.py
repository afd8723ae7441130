"""Per-session bounds on the raw wire, each enforced with every other session unaffected; idle timeout."""

from __future__ import annotations

import logging
import time

import torch

from genie.errors import ConnectionClosedError
from genie.wire.frame import MsgKind
from tests.conftest import wait_until
from tests.raw_client import RawClient, free


def _open(port: int) -> RawClient:
    c = RawClient(port)
    c.handshake()
    return c


def upload_and_check(c: RawClient, storage_id: int, n: int = 1024) -> torch.Tensor:
    t = torch.arange(n, dtype=torch.float32) + storage_id
    c.send_batch([], uploads=[(storage_id, 0, t)])
    assert torch.equal(c.fetch(storage_id, t), t)
    return t


def test_session_memory_quota_names_the_limit_and_spares_other_sessions(dp_server):
    server = dp_server(max_session_bytes=1 << 20)
    with _open(server.port) as greedy, _open(server.port) as polite:
        kept = upload_and_check(polite, 1)
        upload_and_check(greedy, 1, n=200_000)  # 800 kB: fits
        greedy.send_batch([], uploads=[(2, 0, torch.zeros(100_000))])  # 400 kB more: over 1 MiB
        [err] = greedy.sync().deferred
        assert err["kind"] == "quota" and "limit 1048576 (max_session_bytes)" in err["message"]
        assert torch.equal(polite.fetch(1, kept), kept)
        upload_and_check(polite, 2, n=200_000)  # the other session has its own budget
        upload_and_check(greedy, 3)  # and the greedy one goes on within its quota
        per = server.stats()["per_session"]
        assert sorted(p["bytes"] for p in per.values()) == [1024 * 4 + 800_000, 800_000 + 4096]


def test_session_storage_quota_names_the_limit_and_spares_other_sessions(dp_server):
    server = dp_server(max_session_handles=3)
    with _open(server.port) as greedy, _open(server.port) as polite:
        upload_and_check(polite, 1)
        greedy.send_batch([], uploads=[(s, 0, torch.ones(4)) for s in (1, 2, 3, 4)])
        [err] = greedy.sync().deferred
        assert err["kind"] == "quota" and "limit 3 (max_session_handles)" in err["message"]
        for s in (2, 3):
            upload_and_check(polite, s)


def test_frame_size_bound_closes_only_the_offending_session(dp_server, caplog):
    server = dp_server(max_frame_bytes=64 << 10)
    with _open(server.port) as polite:
        upload_and_check(polite, 1)
        with RawClient(server.port) as raw, caplog.at_level(logging.WARNING, "genie.server"):
            raw.handshake()
            raw.send_batch([], uploads=[(1, 0, torch.zeros(32 << 10))])  # 128 KiB payload
            kind, body, _ = raw.recv()
            assert kind == MsgKind.ERROR and "exceeds this session's 65536-byte limit" in body["reason"]
        upload_and_check(polite, 2)
        wait_until(lambda: server.stats()["sessions"] == 1, timeout=5)


def test_inflight_bound_refuses_oversized_batches_with_a_clear_error(dp_server):
    server = dp_server(max_session_inflight=8)
    with _open(server.port) as polite:
        upload_and_check(polite, 1)
        with RawClient(server.port) as raw:
            assert raw.handshake()["limits"]["max_session_inflight"] == 8
            raw.send_batch([free(i) for i in range(9)])
            kind, body, _ = raw.recv()
            assert kind == MsgKind.ERROR and body["code"] == "quota"
            assert "limit 8 (max_session_inflight)" in body["reason"]
        upload_and_check(polite, 2)  # the real client's batches stay within the bound


def test_idle_sessions_time_out_and_free_their_memory(dp_server, caplog):
    server = dp_server(session_idle_timeout=0.5)
    with _open(server.port) as idle, _open(server.port) as busy:
        upload_and_check(idle, 1, n=50_000)
        upload_and_check(busy, 1)
        assert server.stats()["storages"] == 2 and server.stats()["bytes"] == 200_000 + 4096
        with caplog.at_level(logging.WARNING, "genie.server"):
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                busy.sync()  # activity keeps a session alive
                # Not a wait: a client active every 0.1 s for three idle timeouts is the behaviour under
                # test (that the busy session outlives them needs the time to pass).
                time.sleep(0.1)
        stats = server.stats()
        assert stats["sessions"] == 1 and stats["storages"] == 1 and stats["bytes"] == 4096
        assert "idle for more than 0.5 s (session_idle_timeout)" in caplog.text
        try:
            idle.sync()
        except ConnectionClosedError:
            pass
        else:
            raise AssertionError("an idle session's connection must be closed")
