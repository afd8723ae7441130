"""The node's content-addressed weight cache: uploaded bytes kept by content key, across sessions.

A new session's ``model.to(device)`` of weights this node already holds costs a hash on the
client and no transfer: the client asks ``CMD_HAVE`` with the content keys of its large
uploads (:mod:`genie.wire.content`), and the bytes of every hit are copied from the cache
into the session's new storage on the server.

- **Scope.** Keys are per client identity by default (an HMAC under a secret only that client
  holds), so entries never cross identities; with ``share_cache`` the keys are plain SHA-256,
  checked here on insert, and a hit needs a proof of possession under the session's nonce
  (docs/SECURITY.md).
- **Copy on adoption.** The cache's bytes are never handed out: a hit copies them into a
  storage of the session's own, so a session's later in-place writes reach neither the cache
  nor another session. On a GPU node that copy runs host to device.
- **Bounds.** ``max_bytes`` of host memory, least recently used entries evicted first; an entry
  larger than the whole cache is not kept. Thread-safe: every session of the node shares it.
"""

from __future__ import annotations

import collections
import hmac
import logging
import threading
from typing import Any

import torch

from genie.wire.content import DEFAULT_MIN_BYTES, KEY_BYTES, possession_proof, shared_key

log = logging.getLogger("genie.server.content")


class ContentCache:
    """Uploaded bytes by content key, bounded by ``max_bytes`` (LRU); ``shared``: one scope for all clients."""

    def __init__(self, max_bytes: int, *, shared: bool = False, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.max_bytes = max_bytes
        self.shared = shared
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple[bytes, int], torch.Tensor] = collections.OrderedDict()
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

    def lookup(self, key: bytes, nbytes: int, *, nonce: bytes = b"", proof: bytes | None = None) -> torch.Tensor | None:
        """The cached bytes (a CPU uint8 tensor never to be written) for ``key``, or None (counted)."""
        with self._lock:
            data = self._entries.get((key, nbytes))
            if data is not None:
                self._entries.move_to_end((key, nbytes))
        if data is not None and self.shared:
            expected = possession_proof(nonce, key, memoryview(data.numpy()))
            if not isinstance(proof, bytes) or not hmac.compare_digest(expected, proof):
                with self._lock:
                    self.refused += 1
                    self.misses += 1
                log.warning("a cache lookup of %d bytes carried no valid proof of possession; treated as a miss",
                            nbytes)
                return None
        with self._lock:
            if data is None:
                self.misses += 1
            else:
                self.hits += 1
                self.bytes_saved += nbytes
        return data

    def insert(self, key: bytes, raw: torch.Tensor) -> bool:
        """Keep a copy of ``raw`` (CPU uint8, the bytes of an upload) under ``key``; False if not kept."""
        nbytes = raw.numel()
        if len(key) != KEY_BYTES or nbytes < self.min_bytes or nbytes > self.max_bytes:
            return False
        with self._lock:
            if (key, nbytes) in self._entries:
                self._entries.move_to_end((key, nbytes))
                return True
        view = memoryview(raw.numpy())
        if self.shared and not hmac.compare_digest(shared_key(view), key):
            with self._lock:
                self.refused += 1
            log.warning("an upload of %d bytes named a content key its bytes do not hash to; not cached", nbytes)
            return False
        copy = raw.clone()  # the session owns raw and may write it in place later
        with self._lock:
            if (key, nbytes) in self._entries:
                return True
            while self._entries and self.bytes + nbytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.numel()
                self.evicted += 1
            self._entries[(key, nbytes)] = copy
            self.bytes += nbytes
            self.inserted += 1
        return True

    def clear(self) -> None:
        """Drop every entry (counters stay)."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Counters for /metrics, heartbeats and tests."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "bytes_saved": self.bytes_saved,
                    "inserted": self.inserted, "evicted": self.evicted, "refused": self.refused}
