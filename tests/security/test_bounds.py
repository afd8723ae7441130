"""Per-session bounds through the real client, each enforced with every other session unaffected; idle timeout."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from genie.errors import QuotaExceededError, RemoteDeviceLost
from genie.wire.frame import MsgKind
from tests.raw_client import RawClient, free


def upload_and_check(conn, handle: int, n: int = 1024) -> torch.Tensor:
    t = torch.arange(n, dtype=torch.float32) + handle
    conn.upload(handle, 0, t)
    assert torch.equal(conn.fetch(handle, torch.float32, (n,)), t)
    return t


def test_session_memory_quota_names_the_limit_and_spares_other_sessions(dp_server, connect):
    server = dp_server(max_session_bytes=1 << 20)
    greedy, polite = connect(server.port), connect(server.port)
    kept = upload_and_check(polite, 1)
    upload_and_check(greedy, 1, n=200_000)  # 800 kB: fits
    greedy.upload(2, 0, torch.zeros(100_000))  # 400 kB more: over 1 MiB
    with pytest.raises(QuotaExceededError, match=r"limit 1048576 \(max_session_bytes\)"):
        greedy.sync()
    assert torch.equal(polite.fetch(1, torch.float32, (1024,)), kept)
    upload_and_check(polite, 2, n=200_000)  # the other session has its own budget
    upload_and_check(greedy, 3)  # and the greedy one goes on within its quota
    per = server.stats()["per_session"]
    assert sorted(p["bytes"] for p in per.values()) == [1024 * 4 + 800_000, 800_000 + 4096]


def test_session_handle_quota_names_the_limit_and_spares_other_sessions(dp_server, connect):
    server = dp_server(max_session_handles=3)
    greedy, polite = connect(server.port), connect(server.port)
    upload_and_check(polite, 1)
    for h in (1, 2, 3, 4):
        greedy.upload(h, 0, torch.ones(4))
    with pytest.raises(QuotaExceededError, match=r"limit 3 \(max_session_handles\)"):
        greedy.sync()
    for h in (2, 3):
        upload_and_check(polite, h)


def test_frame_size_bound_closes_only_the_offending_session(dp_server, connect, caplog):
    server = dp_server(max_frame_bytes=64 << 10)
    polite = connect(server.port)
    upload_and_check(polite, 1)
    with RawClient(server.port) as raw, caplog.at_level(logging.WARNING, "genie.server"):
        raw.handshake()
        raw.send_batch([], uploads=[(1, 0, torch.zeros(32 << 10))])  # 128 KiB payload
        kind, body, _ = raw.recv()
        assert kind == MsgKind.ERROR and "exceeds this session's 65536-byte limit" in body["reason"]
    upload_and_check(polite, 2)
    assert server.stats()["sessions"] == 1


def test_inflight_bound_refuses_oversized_batches_with_a_clear_error(dp_server, connect):
    server = dp_server(max_session_inflight=8)
    polite = connect(server.port)
    upload_and_check(polite, 1)
    with RawClient(server.port) as raw:
        assert raw.handshake()["limits"]["max_session_inflight"] == 8
        raw.send_batch([free(i) for i in range(9)])
        kind, body, _ = raw.recv()
        assert kind == MsgKind.ERROR and body["code"] == "quota"
        assert "limit 8 (max_session_inflight)" in body["reason"]
    upload_and_check(polite, 2)  # the real client's batches stay within the bound: it sends at most 512


def test_idle_sessions_time_out_and_free_their_memory(dp_server, connect, caplog):
    server = dp_server(session_idle_timeout=0.5)
    idle, busy = connect(server.port), connect(server.port)
    upload_and_check(idle, 1, n=50_000)
    upload_and_check(busy, 1)
    assert server.stats()["handles"] == 2 and server.stats()["bytes"] == 200_000 + 4096
    with caplog.at_level(logging.WARNING, "genie.server"):
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            busy.sync()  # activity keeps a session alive
            time.sleep(0.1)
    stats = server.stats()
    assert stats["sessions"] == 1 and stats["handles"] == 1 and stats["bytes"] == 4096
    assert "idle for more than 0.5 s (session_idle_timeout)" in caplog.text
    with pytest.raises(RemoteDeviceLost):
        idle.sync()
