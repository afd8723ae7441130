"""The node's content-addressed weight cache: uploaded bytes kept by content key, across sessions.

A new session's ``model.to(device)`` of weights this node already holds costs a hash on the
client and no transfer: the client asks ``CMD_HAVE`` with the content keys of its large
uploads (:mod:`genie.wire.content`), and every hit becomes the session's storage without a
byte on the wire.

- **Scope.** Keys are per client identity by default (an HMAC under a secret only that client
  holds), so entries never cross identities; with ``share_cache`` the keys are plain SHA-256,
  checked here on insert, and a hit needs a proof of possession under the session's nonce
  (docs/SECURITY.md).
- **Copy on write.** Each entry is a sealed memfd (host memory). A session gets a *private*
  mapping of it (``MAP_PRIVATE``): no copy when it is made, and the first write to a page copies
  that page for the session alone, so a session's in-place writes reach neither the cache nor
  another session. An upload that names a key is received straight into a new memfd, which
  the cache keeps while the session maps it privately: a miss costs no copy either. On a GPU
  node a hit is copied host to device.
- **Bounds.** ``max_bytes`` of host memory and :data:`MAX_ENTRIES` entries (each holds a file
  descriptor), least recently used evicted first; an entry larger than the whole cache is not
  kept. An evicted entry's memory lives on while sessions still map it (their quota counts it).
  Thread-safe: every session of the node shares it.
"""

from __future__ import annotations

import collections
import fcntl
import hmac
import logging
import os
import threading
from typing import Any

import torch

from genie.wire.buffers import tensor_bytes
from genie.wire.content import DEFAULT_MIN_BYTES, KEY_BYTES, possession_proof, shared_key

log = logging.getLogger("genie.server.content")

#: Most entries kept (each holds one file descriptor).
MAX_ENTRIES = 8192
_SEALS = getattr(fcntl, "F_SEAL_WRITE", 8) | getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)


def supported() -> bool:
    """Whether this platform has what the cache needs (memfd, Linux)."""
    return hasattr(os, "memfd_create")


def _mapping(fd: int, nbytes: int, *, shared: bool) -> torch.UntypedStorage:
    """A CPU storage over the memfd ``fd``: ``shared`` writes reach the file, else they stay private (COW)."""
    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=shared, nbytes=nbytes)
    assert isinstance(storage, torch.UntypedStorage)
    return storage


def _bytes_of(storage: torch.UntypedStorage) -> memoryview:
    return tensor_bytes(torch.empty(0, dtype=torch.uint8).set_(storage))


def private_mapping(fd: int | None, nbytes: int) -> torch.UntypedStorage | None:
    """A private (copy-on-write) storage over the memfd ``fd``, which is closed; None for None."""
    if fd is None:
        return None
    try:
        return _mapping(fd, nbytes, shared=False)
    finally:
        os.close(fd)


class Receiver:
    """A new memfd mapped writable, for one keyed upload to be received into; :meth:`ContentCache.keep` it after."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("genie-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            self.buffer = torch.empty(0, dtype=torch.uint8).set_(_mapping(self.fd, nbytes, shared=True))
        except BaseException:
            os.close(self.fd)
            raise

    @classmethod
    def adopt(cls, fd: int, nbytes: int) -> Receiver:
        """A receiver over a memfd another process filled (a session worker's; see
        :mod:`genie.server.isolation.cache`): no writable mapping; :meth:`close` closes ``fd``."""
        received = cls.__new__(cls)
        received.nbytes, received.fd = nbytes, fd
        received.buffer = torch.empty(0, dtype=torch.uint8)
        return received

    def private(self) -> torch.UntypedStorage:
        """The received bytes as a storage of the session's own (copy on write)."""
        return _mapping(self.fd, self.nbytes, shared=False)

    def release(self) -> None:
        """Drop the writable mapping (once the bytes are in): the file can be sealed then."""
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        """Drop the writable mapping and the descriptor (idempotent); what maps the file keeps it."""
        self.release()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ContentCache:
    """Uploaded bytes by content key, bounded by ``max_bytes`` (LRU); ``shared``: one scope for all clients."""

    def __init__(self, max_bytes: int, *, shared: bool = False, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.max_bytes = max_bytes
        self.shared = shared
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple[bytes, int], int] = collections.OrderedDict()  # -> memfd
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.bytes_saved = 0
        self.inserted = 0
        self.evicted = 0
        self.refused = 0  #: inserts whose bytes did not match their key, and lookups whose proof failed

    def offer(self, nonce: bytes) -> dict[str, Any]:
        """What a session's WELCOME tells its client (``cache``): scope, threshold, the session's nonce."""
        return {"enabled": True, "shared": self.shared, "min_bytes": self.min_bytes,
                "nonce": nonce if self.shared else b""}

    def __len__(self) -> int:
        return len(self._entries)

    def wants(self, nbytes: int) -> bool:
        """Whether an upload of ``nbytes`` could be kept."""
        return self.min_bytes <= nbytes <= self.max_bytes

    def lookup(self, key: bytes, nbytes: int, *, nonce: bytes = b"",
               proof: bytes | None = None) -> torch.UntypedStorage | None:
        """A private (copy-on-write) CPU storage of the bytes under ``key``, or None (counted)."""
        return private_mapping(self.lookup_fd(key, nbytes, nonce=nonce, proof=proof), nbytes)

    def lookup_fd(self, key: bytes, nbytes: int, *, nonce: bytes = b"", proof: bytes | None = None) -> int | None:
        """A new descriptor of the sealed memfd holding the bytes under ``key`` (the caller closes it), or
        None; in the shared scope only with a valid ``proof`` of possession under ``nonce``. Counted."""
        with self._lock:
            fd = self._entries.get((key, nbytes))
            if fd is not None:
                self._entries.move_to_end((key, nbytes))
                fd = os.dup(fd)  # under the lock: eviction closes the cache's own descriptor
        if fd is not None and self.shared:
            mapping = _mapping(fd, nbytes, shared=False)  # alive while its bytes are read
            expected = possession_proof(nonce, key, _bytes_of(mapping))
            del mapping
            if not isinstance(proof, bytes) or not hmac.compare_digest(expected, proof):
                os.close(fd)
                with self._lock:
                    self.refused += 1
                    self.misses += 1
                log.warning("a cache lookup of %d bytes carried no valid proof of possession; treated as a miss",
                            nbytes)
                return None
        with self._lock:
            if fd is None:
                self.misses += 1
            else:
                self.hits += 1
                self.bytes_saved += nbytes
        return fd

    def keep(self, key: bytes, received: Receiver) -> bool:
        """Keep the bytes ``received`` holds under ``key`` (its descriptor passes to the cache); False if not kept."""
        nbytes = received.nbytes
        if len(key) != KEY_BYTES or not self.wants(nbytes):
            return False
        private = received.private() if self.shared else None  # kept alive while its bytes are hashed
        if private is not None and not hmac.compare_digest(shared_key(_bytes_of(private)), key):
            with self._lock:
                self.refused += 1
            log.warning("an upload of %d bytes named a content key its bytes do not hash to; not cached", nbytes)
            return False
        fd = os.dup(received.fd)
        try:
            fcntl.fcntl(fd, _ADD_SEALS, _SEALS)  # nobody writes the file again: sessions map it privately
        except OSError:
            pass  # best effort: the writable mapping may still be alive on some kernels; nothing writes it
        evicted: list[int] = []
        with self._lock:
            if (key, nbytes) in self._entries:
                self._entries.move_to_end((key, nbytes))
                evicted.append(fd)
            else:
                while self._entries and (self.bytes + nbytes > self.max_bytes or len(self._entries) >= MAX_ENTRIES):
                    (_, old_n), old_fd = self._entries.popitem(last=False)
                    self.bytes -= old_n
                    self.evicted += 1
                    evicted.append(old_fd)
                self._entries[(key, nbytes)] = fd
                self.bytes += nbytes
                self.inserted += 1
        for old in evicted:
            os.close(old)
        return True

    def clear(self) -> None:
        """Drop every entry (counters stay)."""
        with self._lock:
            fds = list(self._entries.values())
            self._entries.clear()
            self.bytes = 0
        for fd in fds:
            os.close(fd)

    def stats(self) -> dict[str, int]:
        """Counters for /metrics, heartbeats and tests."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "bytes_saved": self.bytes_saved,
                    "inserted": self.inserted, "evicted": self.evicted, "refused": self.refused}
