"""The node's weight cache, reached from session workers.

The cache (:class:`~genie.server.content.ContentCache`) must outlive sessions, so it lives in
the node's process; a session worker reaches it over its control pipe and memory crosses as
file descriptors (``SCM_RIGHTS``), never as bytes:

=====================================================  ==========================================
worker → node                                          node → worker
=====================================================  ==========================================
``["cache_get", seq, key, nbytes, nonce, proof]``      ``["cache_got", seq, hit]``, then on a hit
                                                       the entry's sealed memfd
``["cache_keep", key, nbytes]``, then the memfd the    nothing (the node keeps it, or not)
worker received the upload into
=====================================================  ==========================================

A hit becomes the session's private (copy-on-write) mapping of the file, exactly as with
sessions in threads. The node trusts nothing a worker sends: a kept descriptor must be a memfd
of exactly ``nbytes`` (:func:`adopt_upload`), keys are checked by the cache as for any upload,
and a worker that breaks these rules is killed like any worker that breaks the control protocol.
"""

from __future__ import annotations

import os
import threading
from multiprocessing import reduction
from typing import Any

from genie.server.content import ContentCache, Receiver, private_mapping
from genie.wire.frame import pack_body

#: Seconds a worker waits for the node's answer to a lookup (then it is a miss).
LOOKUP_WAIT = 10.0
_GET_SEALS = 1034  # fcntl.F_GET_SEALS: fails on anything but a memfd


def offer_of(cache: ContentCache | None) -> dict[str, Any] | None:
    """What a worker needs to stand in for ``cache`` (None: the node keeps no cache); pickled into its spec."""
    if cache is None:
        return None
    return {"max_bytes": cache.max_bytes, "shared": cache.shared, "min_bytes": cache.min_bytes}


class WorkerCache:
    """The worker's stand-in for the node's cache: :class:`~genie.server.content.ContentCache`'s
    ``offer``/``wants``/``lookup``/``keep``, answered by the node over the control pipe.

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
        self._answers: dict[int, int | None] = {}
        self._cond = threading.Condition()

    def offer(self, nonce: bytes) -> dict[str, Any]:
        return {"enabled": True, "shared": self.shared, "min_bytes": self.min_bytes,
                "nonce": nonce if self.shared else b""}

    def wants(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes <= self.max_bytes

    def lookup(self, key: bytes, nbytes: int, *, nonce: bytes = b"", proof: bytes | None = None) -> Any:
        """A private mapping of the node's entry, or None (a miss, or no answer in time)."""
        with self._cond:
            self._seq += 1
            seq = self._seq
        with self._send_lock:
            self._conn.send_bytes(pack_body(["cache_get", seq, key, nbytes, nonce, proof]))
        with self._cond:
            self._cond.wait_for(lambda: seq in self._answers, LOOKUP_WAIT)
            fd = self._answers.pop(seq, None)
        return private_mapping(fd, nbytes)

    def answered(self, seq: Any, hit: Any) -> None:
        """The control thread read ``["cache_got", seq, hit]``; on a hit the descriptor follows on the pipe."""
        fd = reduction.recv_handle(self._conn) if hit else None
        with self._cond:
            self._answers[int(seq)] = fd
            self._cond.notify_all()

    def keep(self, key: bytes, received: Receiver) -> bool:
        """Hand the memfd the upload landed in to the node, which may keep it."""
        if not self.wants(received.nbytes):
            return False
        with self._send_lock:
            self._conn.send_bytes(pack_body(["cache_keep", key, received.nbytes]))
            reduction.send_handle(self._conn, received.fd, os.getppid())
        return True


def answer_lookup(cache: ContentCache | None, conn: Any, send_lock: threading.Lock, message: list[Any]) -> None:
    """The node's side of ``["cache_get", seq, key, nbytes, nonce, proof]``."""
    _, seq, key, nbytes, nonce, proof = message
    if not isinstance(seq, int) or not isinstance(key, bytes) or not isinstance(nbytes, int) \
            or not isinstance(nonce, bytes) or not (proof is None or isinstance(proof, bytes)):
        raise ValueError("cache_get needs [seq, key bytes, nbytes, nonce bytes, proof bytes or None]")
    fd = cache.lookup_fd(key, nbytes, nonce=nonce, proof=proof) if cache is not None and nbytes > 0 else None
    try:
        with send_lock:
            conn.send_bytes(pack_body(["cache_got", seq, fd is not None]))
            if fd is not None:
                reduction.send_handle(conn, fd, 0)
    finally:
        if fd is not None:
            os.close(fd)


def adopt_upload(cache: ContentCache | None, conn: Any, message: list[Any]) -> None:
    """The node's side of ``["cache_keep", key, nbytes]`` and the descriptor after it."""
    fd = reduction.recv_handle(conn)
    received = Receiver.adopt(fd, 0)
    try:
        _, key, nbytes = message
        if not isinstance(key, bytes) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError("cache_keep needs [key bytes, nbytes > 0]")
        try:
            import fcntl

            fcntl.fcntl(fd, _GET_SEALS)
        except OSError:
            raise ValueError("cache_keep's descriptor is not a memfd") from None
        if os.fstat(fd).st_size != nbytes:
            raise ValueError(f"cache_keep's memfd does not hold {nbytes} bytes")
        received.nbytes = nbytes
        if cache is not None:
            cache.keep(key, received)
    finally:
        received.close()
