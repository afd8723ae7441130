"""The shared weight cache under hostile clients and workers (issue 28, findings 5 to 7), against real nodes.

- not an oracle: a held key without a valid proof is refused as fast as a missing key, and a
  session's HAVEs are bounded (entries per HAVE, entries per second), logged a few lines at a time;
- sealed: the node keeps only memfds sealed against writes, shrinking, growing and new seals;
  the honest path seals every entry, and nobody can change or truncate one afterwards;
- bound: an identity-scope key read off the wire lets another identity neither read the entry
  nor put other bytes under it, before or after the entry is evicted.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from typing import Any

import pytest
import torch

from genie.server import DataPlaneServer
from genie.server import content as sc
from genie.server.isolation.cache import adopt_upload
from genie.testing import wait_until
from genie.wire.buffers import tensor_bytes
from genie.wire.content import MAX_HAVE_ENTRIES, fingerprint, identity_claim, possession_proof, shared_claim
from genie.wire.frame import MsgKind
from tests.raw_client import RawClient, desc, fetch, have

Start = Callable[..., DataPlaneServer]
NBYTES = 256 << 10
VICTIM, ATTACKER = os.urandom(32), os.urandom(32)

pytestmark = pytest.mark.skipif(not sc.supported(), reason="the weight cache needs memfd (Linux)")


@pytest.fixture(autouse=True)
def fresh_cache_refusals() -> None:
    """Each test sees its own refusals logged (the process-wide limiter would swallow them after a few)."""
    sc.REFUSALS.reset()


def _weights(seed: int) -> torch.Tensor:
    return torch.randn(NBYTES // 4, generator=torch.Generator().manual_seed(seed))


def _identity(t: torch.Tensor, secret: bytes) -> tuple[bytes, bytes]:
    return identity_claim(secret, fingerprint(tensor_bytes(t)))


def _shared(t: torch.Tensor) -> tuple[bytes, bytes]:
    return shared_claim(fingerprint(tensor_bytes(t)))


def _client(server: DataPlaneServer) -> RawClient:
    client = RawClient(server.port)
    client.handshake()
    return client


def _cache(server: DataPlaneServer) -> sc.ContentCache:
    assert server.cache is not None
    return server.cache


def _upload(server: DataPlaneServer, t: torch.Tensor, key: bytes, possession: bytes, storage_id: int = 1) -> None:
    """Upload ``t`` named ``key`` in a session of its own; wait until the node has judged it."""
    cache = _cache(server)
    before = cache.stats()
    with _client(server) as c:
        reply = c.request([fetch(c.next_req(), desc(storage_id, t))], uploads=[(storage_id, 0, t, key, possession)])
        assert reply.error is None
    wait_until(lambda: cache.idle() and (cache.stats()["inserted"], cache.stats()["refused"])
               != (before["inserted"], before["refused"]), 5)


def _have(client: RawClient, entries: list[list[Any]]) -> list[bool]:
    reply = client.request([have(client.next_req(), entries)])
    assert reply.error is None, reply.error
    return [bool(x) for x in reply.result]


def _proof(client: RawClient, key: bytes, possession: bytes) -> bytes:
    return possession_proof(possession, client.welcome["cache"]["nonce"], key, NBYTES)


# -- finding 5: not an oracle, bounded -------------------------------------------------------------

@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_held_key_without_a_valid_proof_is_refused_as_fast_as_a_missing_key(dp_server: Start,
                                                                              isolation: str) -> None:
    """Before: the node mapped and hashed a held entry to check the proof, a missing key returned at
    once (8.9x here for HAVEs of 32 entries). Now both are one HMAC per entry."""
    server = dp_server(share_cache=True, isolation=isolation)
    w = _weights(0)
    key, secret = _shared(w)
    _upload(server, w, key, secret)
    with _client(server) as b:
        held = [[key, NBYTES, os.urandom(32)] for _ in range(32)]
        missing = [[os.urandom(32), NBYTES, os.urandom(32)] for _ in range(32)]

        def timed(entries: list[list[Any]]) -> float:
            started = time.perf_counter()
            assert not any(_have(b, entries))
            return time.perf_counter() - started

        for _ in range(3):  # warm both paths
            timed(held), timed(missing)
        held_s, missing_s = [], []
        for _ in range(15):  # interleaved: a busy moment slows both alike
            held_s.append(timed(held))
            missing_s.append(timed(missing))
        # The fastest of each: what the node's work costs, least disturbed by other processes on the machine
        # (the suite runs beside others). The old path was 8.9x; a bound of 3x leaves room for that noise.
        ratio = min(held_s) / min(missing_s)
        assert ratio < 3.0, f"held {min(held_s) * 1e3:.2f} ms, missing {min(missing_s) * 1e3:.2f} ms: {ratio:.2f}x " \
                            f"(medians {statistics.median(held_s) * 1e3:.2f} and {statistics.median(missing_s) * 1e3:.2f} ms)"
        assert _have(b, [[key, NBYTES, _proof(b, key, secret)]]) == [True]  # the valid proof still hits
    assert _cache(server).stats()["refused"] == 18 * 32


def test_a_have_of_more_entries_than_a_client_ever_asks_about_is_refused_at_once(dp_server: Start) -> None:
    """Before: one HAVE of 65,536 entries of a held key took 112 s of the node process."""
    server = dp_server(share_cache=True)
    w = _weights(0)
    key, _ = _shared(w)
    _upload(server, w, key, _shared(w)[1])
    with _client(server) as c:
        started = time.perf_counter()
        c.send_batch([have(c.next_req(), [[key, NBYTES, os.urandom(32)]] * (16 * MAX_HAVE_ENTRIES))])
        kind, body, _ = c.recv()
        assert kind == MsgKind.ERROR and "at most 4096 keys" in body["reason"]
        assert time.perf_counter() - started < 3.0
    stats = _cache(server).stats()
    assert stats["hits"] + stats["misses"] == 0  # not one entry looked up
    with _client(server) as other:  # the node serves everyone else
        assert _have(other, [[key, NBYTES, _proof(other, key, _shared(w)[1])]]) == [True]


def test_a_flood_of_haves_is_capped_by_the_session_budget_and_logged_a_few_lines_at_a_time(
        dp_server: Start, caplog: pytest.LogCaptureFixture) -> None:
    server = dp_server(share_cache=True)
    w = _weights(0)
    key, secret = _shared(w)
    _upload(server, w, key, secret)
    flood = [[key, NBYTES, os.urandom(32)]] * MAX_HAVE_ENTRIES
    with caplog.at_level(logging.WARNING, "genie"), _client(server) as c:
        started = time.perf_counter()
        for _ in range(16):  # 65,536 entries of a held key with wrong proofs
            assert not any(_have(c, flood))
        elapsed = time.perf_counter() - started
    stats = _cache(server).stats()
    looked_up = stats["hits"] + stats["misses"]
    assert looked_up <= sc.HAVE_BURST + sc.HAVE_RATE * elapsed + 1
    assert looked_up < 16 * MAX_HAVE_ENTRIES
    assert elapsed < 20.0, f"{elapsed:.1f} s for 16 capped HAVEs"
    budget_lines = [r for r in caplog.records if "beyond its budget" in r.getMessage()]
    assert 1 <= len(budget_lines) <= sc.REFUSALS.burst + 1
    with _client(server) as fresh:  # the budget is the session's: a new one hits
        assert _have(fresh, [[key, NBYTES, _proof(fresh, key, secret)]]) == [True]


# -- finding 6: sealed entries ----------------------------------------------------------------------

def test_the_honest_path_seals_every_entry_and_nobody_can_change_or_truncate_one(dp_server: Start) -> None:
    """Before: the node sealed best effort while the worker could still hold its writable mapping (2 of 8
    entries were left unsealed in two runs of three), and kept the memfd either way."""
    server = dp_server()
    cache = _cache(server)
    tensors = [_weights(i) for i in range(8)]
    with _client(server) as a:  # eight keyed uploads in one batch, received by the session's worker
        ups = [(i + 1, 0, t, *_identity(t, VICTIM)) for i, t in enumerate(tensors)]
        assert a.request([fetch(a.next_req(), desc(1, tensors[0]))], uploads=ups).error is None
    wait_until(lambda: cache.idle() and cache.stats()["inserted"] == 8, 5)
    fds = cache.entry_fds()
    assert len(fds) == 8 and all(sc.is_sealed(fd) for fd in fds), [sc.seals_of(fd) for fd in fds]
    for fd in fds:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 16, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    with _client(server) as b:
        key, possession = _identity(tensors[3], VICTIM)
        assert _have(b, [[key, NBYTES, _proof(b, key, possession)]]) == [True]
        b.send_batch([], cached=[[9, 0, NBYTES, key]])
        assert torch.equal(b.fetch(9, tensors[3]), tensors[3])


@pytest.fixture
def worker_pipe() -> Iterator[tuple[Any, Any]]:
    """A control pipe like a session worker's: (the node's end, the worker's end)."""
    node_end, worker_end = multiprocessing.Pipe()
    yield node_end, worker_end
    node_end.close()
    worker_end.close()


def _memfd(t: torch.Tensor, seals: int) -> int:
    fd = os.memfd_create("hostile-worker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, bytes(tensor_bytes(t)))
    if seals:
        import fcntl

        fcntl.fcntl(fd, sc.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("seals", [0, sc.REQUIRED_SEALS & ~8, sc.REQUIRED_SEALS & ~2,
                                   sc.REQUIRED_SEALS & ~sc.F_SEAL_SEAL],
                         ids=["unsealed", "writable", "shrinkable", "seals-open"])
def test_the_node_refuses_a_memfd_a_worker_did_not_seal(dp_server: Start, worker_pipe: tuple[Any, Any],
                                                        seals: int) -> None:
    """A hostile worker hands the node's cache a memfd it can still write, truncate or seal further
    (the right bytes and key, so only the seals are wrong); a fully sealed one is kept."""
    server = dp_server()
    cache = _cache(server)
    node_end, worker_end = worker_pipe
    w = _weights(5)
    key, possession = _identity(w, VICTIM)
    for attempt in (seals, sc.REQUIRED_SEALS):
        fd = _memfd(w, attempt)
        reduction.send_handle(worker_end, fd, os.getpid())  # after the message, which is handed over directly
        os.close(fd)  # the worker's copy; the node holds its own
        adopt_upload(cache, node_end, ["cache_keep", key, NBYTES, possession])
        wait_until(cache.idle, 5)
        if attempt == seals:
            assert cache.stats()["refused"] == 1 and cache.stats()["entries"] == 0
    assert cache.stats()["entries"] == 1 and cache.stats()["refused"] == 1
    assert all(sc.is_sealed(fd) for fd in cache.entry_fds())


def test_a_receiver_whose_writable_mapping_is_still_alive_is_not_sealed_nor_kept() -> None:
    cache = sc.ContentCache(4 * NBYTES)
    w = _weights(6).view(torch.uint8)
    received = sc.Receiver(NBYTES)
    try:
        writable = received.buffer  # a writable mapping someone still holds
        writable.copy_(w)
        assert not received.seal()
        assert not cache.keep(*_identity(w, VICTIM), received)
        del writable
        assert received.seal() and cache.keep(*_identity(w, VICTIM), received)
    finally:
        received.close()
    assert cache.stats()["entries"] == 1 and cache.stats()["refused"] == 1


# -- finding 7: identity-scope entries are bound to their owner ---------------------------------------

def test_another_identity_with_the_key_can_neither_read_nor_replace_an_identity_scope_entry(
        dp_server: Start) -> None:
    """The attacker knows the victim's key (plaintext on the wire without TLS) and even, for the last
    attempts, the possession secret an insert carried. Before: the key alone read the bytes, and after an
    eviction the attacker's bytes uploaded under it were the victim's next hit."""
    server = dp_server(cache_bytes=2 * NBYTES)
    cache = _cache(server)
    victim_w, forged = _weights(10), _weights(11)
    key, possession = _identity(victim_w, VICTIM)
    _upload(server, victim_w, key, possession)
    with _client(server) as attacker:
        assert _have(attacker, [[key, NBYTES, None], [key, NBYTES, os.urandom(32)],
                                [key, NBYTES, _proof(attacker, key, _identity(victim_w, ATTACKER)[1])]]) \
            == [False] * 3
        reply = attacker.request([fetch(attacker.next_req(), desc(4, victim_w))], cached=[[4, 0, NBYTES, key]])
        assert reply.error is not None and "CMD_HAVE" in reply.error["message"]  # nothing reserved to take
    _upload(server, forged, key, _identity(forged, ATTACKER)[1])  # its own possession: the key does not bind it
    _upload(server, forged, key, possession)  # the victim's possession, other bytes: the root does not match
    assert cache.stats()["refused"] == 2 + 3 and cache.stats()["entries"] == 1
    for i in range(2):  # evict the victim's entry (least recently used)
        filler = _weights(20 + i)
        _upload(server, filler, *_identity(filler, ATTACKER))
    assert cache.stats()["evicted"] >= 1
    _upload(server, forged, key, possession)  # the key is free now: still only the victim's bytes fit it
    assert cache.stats()["refused"] == 2 + 3 + 1
    with _client(server) as victim:
        assert _have(victim, [[key, NBYTES, _proof(victim, key, possession)]]) == [False]  # a miss, not forgery
    _upload(server, victim_w, key, possession)  # the victim's client sends its bytes again
    with _client(server) as victim:
        assert _have(victim, [[key, NBYTES, _proof(victim, key, possession)]]) == [True]
        victim.send_batch([], cached=[[2, 0, NBYTES, key]])
        assert torch.equal(victim.fetch(2, victim_w), victim_w)


def test_an_upload_naming_a_key_without_its_possession_secret_is_not_kept(dp_server: Start) -> None:
    server = dp_server()
    w = _weights(12)
    key, _ = _identity(w, VICTIM)
    with _client(server) as c:  # an older client's [storage_id, device, nbytes, key]: applied, never cached
        assert c.request([fetch(c.next_req(), desc(1, w))], uploads=[(1, 0, w, key)]).error is None
        assert torch.equal(c.fetch(1, w), w)
    wait_until(lambda: _cache(server).stats()["refused"] == 1, 5)
    assert _cache(server).stats()["entries"] == 0


def test_a_possession_proof_is_bound_to_its_session_key_and_size() -> None:
    w = _weights(13)
    key, possession = _identity(w, VICTIM)
    nonce, other = os.urandom(32), os.urandom(32)
    proof = possession_proof(possession, nonce, key, NBYTES)
    assert proof != possession_proof(possession, other, key, NBYTES)
    assert proof != possession_proof(possession, nonce, key, NBYTES - 4)
    assert proof != possession_proof(possession, nonce, os.urandom(32), NBYTES)
    root, secret = _shared(w)
    assert root != secret and key not in (root, secret) and possession not in (root, secret)
