"""The node's weight cache, reached from session workers.

The cache (:class:`~genie.server.content.ContentCache`) must outlive sessions, so it lives in
the node's process; a session worker reaches it over its control pipe and memory crosses as
file descriptors (``SCM_RIGHTS``), never as bytes:

=========================================================  ======================================
worker → node                                              node → worker
=========================================================  ======================================
``["cache_get", seq, nonce, [[key, nbytes, proof], ...]]`` ``["cache_got", seq, [hit, ...]]``, then
(one per HAVE, at most                                     each hit's sealed memfd, in order
:data:`~genie.wire.content.MAX_HAVE_ENTRIES` entries)
``["cache_keep", key, nbytes, possession]``, then the      nothing (the node keeps it, or not)
sealed memfd the worker received the upload into
=========================================================  ======================================

The worker parses the client's HAVE, applies the session's :class:`~genie.server.content.HaveBudget`
and maps the hits; the node does only what needs its secrets: one HMAC per entry, the same for
held and missing keys (:meth:`~genie.server.content.ContentCache.have_fds`). A hit becomes the
session's private (copy-on-write) mapping of the file, exactly as with sessions in threads.

The node trusts nothing a worker sends: it applies a budget of its own per worker pipe, a kept
descriptor must be a memfd of exactly ``nbytes`` sealed against writes, shrinking and growing
(an unsealed one is refused, :func:`adopt_upload`), and its bytes are hashed against their key
on the cache's checker thread, off this pipe's watcher. A worker that breaks the message rules
is killed like any worker that breaks the control protocol.
"""

from __future__ import annotations

import os
import threading
import weakref
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any

from genie.server.content import ContentCache, HaveBudget, Receiver, private_mapping, seals_of
from genie.wire.content import KEY_BYTES, MAX_HAVE_ENTRIES
from genie.wire.frame import pack_body

if TYPE_CHECKING:
    import torch

#: Seconds a worker waits for the node's answer to a HAVE (then every entry is a miss).
LOOKUP_WAIT = 10.0

#: The node's own budget per worker pipe (a worker that skips its budget gets no further).
_budgets: weakref.WeakKeyDictionary[Any, HaveBudget] = weakref.WeakKeyDictionary()
_budgets_lock = threading.Lock()


def offer_of(cache: ContentCache | None) -> dict[str, Any] | None:
    """What a worker needs to stand in for ``cache`` (None: the node keeps no cache); pickled into its spec."""
    if cache is None:
        return None
    return {"max_bytes": cache.max_bytes, "shared": cache.shared, "min_bytes": cache.min_bytes}


class WorkerCache:
    """The worker's stand-in for the node's cache: :class:`~genie.server.content.ContentCache`'s
    ``offer``/``wants``/``have``/``keep``, answered by the node over the control pipe.

    ``conn`` is the pipe, ``send_lock`` the lock every sender on it holds; the worker's control
    thread hands the node's answers to :meth:`answered`.
    """

    def __init__(self, offer: dict[str, Any], conn: Any, send_lock: threading.Lock) -> None:
        self.max_bytes = int(offer["max_bytes"])
        self.shared = bool(offer["shared"])
        self.min_bytes = int(offer["min_bytes"])
        self._conn = conn
        self._send_lock = send_lock
        self._seq = 0
        self._asked: dict[int, list[int]] = {}  #: seq -> the byte counts asked about, while someone waits
        self._answers: dict[int, list[torch.UntypedStorage | None]] = {}
        self._cond = threading.Condition()

    def offer(self, nonce: bytes) -> dict[str, Any]:
        return {"enabled": True, "shared": self.shared, "min_bytes": self.min_bytes, "nonce": nonce}

    def wants(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes <= self.max_bytes

    def have(self, entries: list[tuple[bytes, int, bytes | None]], nonce: bytes) -> list[torch.UntypedStorage | None]:
        """Private mappings of the node's entries for ``entries`` (None: a miss, or no answer in time)."""
        if not entries:
            return []
        with self._cond:
            self._seq += 1
            seq = self._seq
            self._asked[seq] = [nbytes for _, nbytes, _ in entries]
        with self._send_lock:
            self._conn.send_bytes(pack_body(["cache_get", seq, nonce, [list(e) for e in entries]]))
        with self._cond:
            self._cond.wait_for(lambda: seq in self._answers, LOOKUP_WAIT)
            self._asked.pop(seq, None)
            answers = self._answers.pop(seq, None)
        return answers if answers is not None else [None] * len(entries)

    def answered(self, seq: Any, hits: Any) -> None:
        """The control thread read ``["cache_got", seq, [hit, ...]]``; each hit's descriptor follows on the pipe."""
        fds = [reduction.recv_handle(self._conn) if hit is True else None for hit in hits]
        with self._cond:
            asked = self._asked.get(int(seq))
            if asked is None or len(asked) != len(fds):  # nobody waits any more: drop the descriptors
                for fd in fds:
                    if fd is not None:
                        os.close(fd)
                return
            # Mapped here, one at a time: a HAVE's thousands of hits never hold thousands of descriptors.
            self._answers[int(seq)] = [private_mapping(fd, n) for fd, n in zip(fds, asked, strict=True)]
            self._cond.notify_all()

    def keep(self, key: bytes, possession: bytes | None, received: Receiver) -> bool:
        """Hand the sealed memfd the upload landed in to the node, which may keep it."""
        if not self.wants(received.nbytes):
            return False
        with self._send_lock:
            self._conn.send_bytes(pack_body(["cache_keep", key, received.nbytes, possession]))
            reduction.send_handle(self._conn, received.fd, os.getppid())
        return True


def _budget(conn: Any) -> HaveBudget:
    with _budgets_lock:
        budget = _budgets.get(conn)
        if budget is None:
            budget = _budgets[conn] = HaveBudget()
        return budget


def _entries(raw: Any) -> list[tuple[bytes, int, bytes | None]]:
    if not isinstance(raw, list) or len(raw) > MAX_HAVE_ENTRIES:
        raise ValueError(f"cache_get needs a list of at most {MAX_HAVE_ENTRIES} entries")
    entries = []
    for e in raw:
        if (not isinstance(e, list) or len(e) != 3 or not isinstance(e[0], bytes) or len(e[0]) != KEY_BYTES
                or not isinstance(e[1], int) or e[1] <= 0 or not (e[2] is None or isinstance(e[2], bytes))):
            raise ValueError("a cache_get entry must be [key (32 bytes), nbytes > 0, proof bytes or None]")
        entries.append((e[0], e[1], e[2]))
    return entries


def answer_lookup(cache: ContentCache | None, conn: Any, send_lock: threading.Lock, message: list[Any]) -> None:
    """The node's side of ``["cache_get", seq, nonce, entries]``: one bool per entry, then the hits' memfds."""
    _, seq, nonce, raw = message
    if not isinstance(seq, int) or not isinstance(nonce, bytes):
        raise ValueError("cache_get needs [seq, nonce bytes, entries]")
    entries = _entries(raw)
    granted = _budget(conn).take(len(entries)) if cache is not None else 0
    fds: list[int | None] = cache.have_fds(entries[:granted], nonce) if cache is not None else []
    fds += [None] * (len(entries) - len(fds))
    try:
        with send_lock:
            conn.send_bytes(pack_body(["cache_got", seq, [fd is not None for fd in fds]]))
            for fd in fds:
                if fd is not None:
                    reduction.send_handle(conn, fd, 0)
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


def adopt_upload(cache: ContentCache | None, conn: Any, message: list[Any]) -> None:
    """The node's side of ``["cache_keep", key, nbytes, possession]`` and the descriptor after it."""
    fd = reduction.recv_handle(conn)
    try:
        _, key, nbytes, possession = message
        if (not isinstance(key, bytes) or not isinstance(nbytes, int) or nbytes <= 0
                or not (possession is None or isinstance(possession, bytes))):
            raise ValueError("cache_keep needs [key bytes, nbytes > 0, possession bytes or None]")
        if seals_of(fd) is None:
            raise ValueError("cache_keep's descriptor is not a memfd")
        if os.fstat(fd).st_size != nbytes:
            raise ValueError(f"cache_keep's memfd does not hold {nbytes} bytes")
    except BaseException:
        os.close(fd)
        raise
    if cache is None:
        os.close(fd)
        return
    cache.keep_later(key, nbytes, possession, fd)  # an unsealed memfd is refused there at once
