"""The node's content-addressed weight cache: uploaded bytes kept by content key, across sessions.

A new session's ``model.to(device)`` of weights this node already holds costs a hash on the
client and no transfer: the client asks ``CMD_HAVE`` with the content keys of its large
uploads and a proof of possession for each (:mod:`genie.wire.content`), and every hit becomes
the session's storage without a byte on the wire.

- **Not an oracle.** A HAVE entry is a hit only with a valid proof, and the proof is checked
  with the same work whether the key is held or not: one HMAC under the entry's possession
  secret, kept beside it, or under a dummy secret (:meth:`ContentCache.have`). The entry's
  bytes are never touched by a lookup. Each session may ask about :data:`HAVE_BURST` entries
  at once and :data:`HAVE_RATE` more per second (:class:`HaveBudget`); the rest are misses.
- **Bound to their content and owner.** An entry is kept only when its key names the bytes
  received, checked here (:func:`genie.wire.content.checked_possession`): in the identity scope
  the key also binds the uploader's possession secret, so another identity can neither read an
  entry nor put other bytes under its key, and a key evicted and uploaded again can only come
  back with the same bytes. With ``share_cache`` one scope serves every client, each needing
  the bytes (not just their key) to prove possession.
- **Sealed.** Each entry is a memfd sealed against writes, shrinking and growing, and against
  further seals (:data:`REQUIRED_SEALS`, checked with ``F_GET_SEALS`` before the bytes are
  hashed); an unsealed one is refused. A session gets a *private* mapping of it
  (``MAP_PRIVATE``): no copy when it is made, and the first write to a page copies that page
  for the session alone. An upload that names a key is received straight into a new memfd
  (:class:`Receiver`), sealed once every writable mapping of it is gone: a miss costs no copy
  either. On a GPU node a hit is copied host to device.
- **Bounds.** ``max_bytes`` of host memory and :data:`MAX_ENTRIES` entries (each holds a file
  descriptor), least recently used evicted first; an entry larger than the whole cache is not
  kept. An evicted entry's memory lives on while sessions still map it (their quota counts it).
  Thread-safe: every session of the node shares it. Refusals are logged through a
  :class:`~genie.security.RefusalLog` (a few lines per interval, then a count).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hmac
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from genie.security import RefusalLog
from genie.wire.content import DEFAULT_MIN_BYTES, KEY_BYTES, checked_possession, possession_proof

if TYPE_CHECKING:
    import torch

log = logging.getLogger("genie.server.content")

#: Most entries kept (each holds one file descriptor).
MAX_ENTRIES = 8192
#: HAVE entries one session may have looked up at once, and per second after that (a token bucket).
HAVE_BURST = 16384
HAVE_RATE = 4096.0
#: Uploads waiting for the node's check at most (process isolation; their descriptors stay open meanwhile).
MAX_PENDING = 1024
_SLICE = 256  #: entries :meth:`ContentCache.have` asks about at a time
#: Seconds the checker thread waits for more work before it ends (a new upload starts it again).
CHECKER_IDLE = 2.0

F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 1)
#: What a kept memfd must be sealed against: writes, shrinking (SIGBUS for whoever maps it), growing, new seals.
REQUIRED_SEALS = (getattr(fcntl, "F_SEAL_WRITE", 8) | getattr(fcntl, "F_SEAL_SHRINK", 2)
                  | getattr(fcntl, "F_SEAL_GROW", 4) | F_SEAL_SEAL)

#: Refused lookups and uploads of every session of this process, a few lines per interval.
REFUSALS = RefusalLog(log, what="weight cache refusals")


def supported() -> bool:
    """Whether this platform has what the cache needs (memfd, Linux)."""
    return hasattr(os, "memfd_create")


def seals_of(fd: int) -> int | None:
    """The seals of the file ``fd`` (``F_GET_SEALS``); None for a file that cannot be sealed (not a memfd)."""
    try:
        return fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        return None


def is_sealed(fd: int) -> bool:
    """Whether ``fd`` is a memfd with every one of :data:`REQUIRED_SEALS`."""
    seals = seals_of(fd)
    return seals is not None and seals & REQUIRED_SEALS == REQUIRED_SEALS


def _mapping(fd: int, nbytes: int, *, shared: bool) -> torch.UntypedStorage:
    """A CPU storage over the memfd ``fd``: ``shared`` writes reach the file, else they stay private (COW)."""
    import torch  # here: under process isolation the node's process only holds the files (genie.server.host)

    storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=shared, nbytes=nbytes)
    assert isinstance(storage, torch.UntypedStorage)
    return storage


def private_mapping(fd: int | None, nbytes: int) -> torch.UntypedStorage | None:
    """A private (copy-on-write) storage over the memfd ``fd``, which is closed; None for None."""
    if fd is None:
        return None
    try:
        return _mapping(fd, nbytes, shared=False)
    finally:
        os.close(fd)


class HaveBudget:
    """HAVE entries one session may still have looked up: ``burst`` at once, refilled at ``rate`` per second."""

    def __init__(self, burst: int = HAVE_BURST, rate: float = HAVE_RATE) -> None:
        self.burst = burst
        self.rate = rate
        self._tokens = float(burst)
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` entries may be looked up now (the rest are answered as misses)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
            self._at = now
            granted = min(wanted, int(self._tokens))
            self._tokens -= granted
            return granted


class Receiver:
    """A new memfd mapped writable, for one keyed upload to be received into; :meth:`seal` it, then
    :meth:`ContentCache.keep` it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("genie-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            import torch

            self.buffer = torch.empty(0, dtype=torch.uint8).set_(_mapping(self.fd, nbytes, shared=True))
        except BaseException:
            os.close(self.fd)
            raise

    def private(self) -> torch.UntypedStorage:
        """The received bytes as a storage of the session's own (copy on write)."""
        return _mapping(self.fd, self.nbytes, shared=False)

    def release(self) -> None:
        """Drop this receiver's writable mapping (once the bytes are in)."""
        import torch

        self.buffer = torch.empty(0, dtype=torch.uint8)

    def seal(self) -> bool:
        """Drop the writable mapping and seal the file (:data:`REQUIRED_SEALS`); False when it cannot be.

        Sealing against writes fails (``EBUSY``) while any writable shared mapping of the file
        is alive, so the caller must have dropped every tensor over :attr:`buffer` first.
        """
        self.release()
        try:
            fcntl.fcntl(self.fd, F_ADD_SEALS, REQUIRED_SEALS)
        except OSError as exc:
            why = "a writable mapping of it is still alive" if exc.errno == errno.EBUSY else str(exc)
            REFUSALS.warning("an upload of %d bytes cannot be sealed (%s); not cached", self.nbytes, why)
            return False
        return is_sealed(self.fd)

    def close(self) -> None:
        """Drop the writable mapping and the descriptor (idempotent); what maps the file keeps it."""
        self.release()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@attrs.define
class _Entry:
    fd: int  #: the sealed memfd (the cache's own descriptor)
    possession: bytes  #: what a HAVE's proof is checked against


@attrs.define
class _Pending:
    key: bytes
    nbytes: int
    possession: bytes | None
    fd: int  #: owned by the checker until kept or closed


class ContentCache:
    """Uploaded bytes by content key, bounded by ``max_bytes`` (LRU); ``shared``: one scope for all clients."""

    def __init__(self, max_bytes: int, *, shared: bool = False, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.max_bytes = max_bytes
        self.shared = shared
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple[bytes, int], _Entry] = collections.OrderedDict()
        self._dummy = os.urandom(KEY_BYTES)  #: the possession secret a missing key's proof is checked against
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_bytes = 0
        self._checking = 0
        self._checker: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.bytes_saved = 0
        self.inserted = 0
        self.evicted = 0
        self.refused = 0  #: uploads not kept (unsealed, or bytes their key does not name), lookups of held keys
        #: whose proof failed

    def offer(self, nonce: bytes) -> dict[str, Any]:
        """What a session's WELCOME tells its client (``cache``): scope, threshold, the session's nonce."""
        return {"enabled": True, "shared": self.shared, "min_bytes": self.min_bytes, "nonce": nonce}

    def __len__(self) -> int:
        return len(self._entries)

    def wants(self, nbytes: int) -> bool:
        """Whether an upload of ``nbytes`` could be kept."""
        return self.min_bytes <= nbytes <= self.max_bytes

    # -- lookups --------------------------------------------------------------------------------

    def have_fds(self, entries: Sequence[tuple[bytes, int, bytes | None]], nonce: bytes) -> list[int | None]:
        """For each ``(key, nbytes, proof)``: a new descriptor of the sealed memfd holding those bytes (the
        caller closes it) when the node holds them and ``proof`` is :func:`~genie.wire.content.possession_proof`
        of their possession secret under ``nonce``, else None. Counted.

        A held key with a wrong proof costs exactly what a missing key costs: one HMAC under the
        entry's secret or a dummy one, one comparison. Only a valid proof goes on to a descriptor.
        """
        with self._lock:
            found = [self._entries.get((key, nbytes)) for key, nbytes, _ in entries]
        valid = []
        for (key, nbytes, proof), entry in zip(entries, found, strict=True):
            expected = possession_proof(entry.possession if entry is not None else self._dummy, nonce, key, nbytes)
            valid.append(hmac.compare_digest(expected, proof if isinstance(proof, bytes) else b""))
        answers: list[int | None] = []
        with self._lock:
            for (key, nbytes, _), entry, ok in zip(entries, found, valid, strict=True):
                if entry is not None and ok and self._entries.get((key, nbytes)) is entry:
                    self._entries.move_to_end((key, nbytes))
                    answers.append(os.dup(entry.fd))  # under the lock: eviction closes the cache's own descriptor
                    self.hits += 1
                    self.bytes_saved += nbytes
                    continue
                answers.append(None)
                self.misses += 1
                if entry is not None and not ok:
                    self.refused += 1  # counted only: a log line would make a held key slower to refuse
        return answers

    def have(self, entries: Sequence[tuple[bytes, int, bytes | None]],
             nonce: bytes) -> list[torch.UntypedStorage | None]:
        """:meth:`have_fds` as private (copy-on-write) CPU storages of the bytes (asked in slices, so that a
        HAVE's thousands of hits never hold thousands of descriptors at once)."""
        out: list[torch.UntypedStorage | None] = []
        for start in range(0, len(entries), _SLICE):
            part = entries[start:start + _SLICE]
            out += [private_mapping(fd, nbytes) for fd, (_, nbytes, _) in zip(self.have_fds(part, nonce), part,
                                                                               strict=True)]
        return out

    def lookup(self, key: bytes, nbytes: int, *, nonce: bytes = b"",
               proof: bytes | None = None) -> torch.UntypedStorage | None:
        """A private (copy-on-write) CPU storage of the bytes under ``key``, or None (:meth:`have` of one)."""
        return self.have([(key, nbytes, proof)], nonce)[0]

    # -- inserts --------------------------------------------------------------------------------

    def keep(self, key: bytes, possession: bytes | None, received: Receiver) -> bool:
        """Keep the bytes of the sealed memfd ``received`` holds under ``key`` (a descriptor of the cache's
        own); False when not kept: not wanted, not sealed, or ``key`` does not name these bytes."""
        return self._check_and_keep(key, received.nbytes, possession, received.fd)

    def keep_later(self, key: bytes, nbytes: int, possession: bytes | None, fd: int) -> None:
        """:meth:`keep` the memfd ``fd`` (owned from now on) on the cache's checker thread: hashing it does
        not hold up the caller. At most :data:`MAX_PENDING` uploads and ``max_bytes`` wait; more are dropped.
        An unsealed memfd is refused at once."""
        if len(key) != KEY_BYTES or not self.wants(nbytes):
            os.close(fd)
            return
        if not is_sealed(fd):
            self._refuse_unsealed(nbytes, fd)
            os.close(fd)
            return
        with self._lock:
            if len(self._pending) >= MAX_PENDING or self._pending_bytes + nbytes > self.max_bytes:
                full = True
            else:
                full = False
                self._pending.append(_Pending(key, nbytes, possession, fd))
                self._pending_bytes += nbytes
                if self._checker is None:
                    self._checker = threading.Thread(target=self._check_pending, name="genie-cache-checker",
                                                     daemon=True)
                    self._checker.start()
                self._wake.notify()
        if full:
            os.close(fd)
            REFUSALS.warning("an upload of %d bytes was not cached: the node is still checking earlier uploads "
                             "(at most %d, or the cache's size, wait)", nbytes, MAX_PENDING)

    def idle(self) -> bool:
        """Whether no upload waits for :meth:`keep_later`'s check."""
        with self._lock:
            return not self._pending and not self._checking

    def _check_pending(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._wake.wait(CHECKER_IDLE)
                if not self._pending:
                    self._checker = None
                    return
                item = self._pending.popleft()
                self._pending_bytes -= item.nbytes
                self._checking += 1
            try:
                self._check_and_keep(item.key, item.nbytes, item.possession, item.fd)
            except Exception:  # the checker must go on for other uploads
                log.exception("checking an upload of %d bytes for the weight cache failed", item.nbytes)
            finally:
                os.close(item.fd)
                with self._lock:
                    self._checking -= 1

    def _refuse(self, msg: str, *args: Any) -> bool:
        with self._lock:
            self.refused += 1
        REFUSALS.warning(msg, *args)
        return False

    def _refuse_unsealed(self, nbytes: int, fd: int) -> bool:
        return self._refuse("an upload of %d bytes came in a memfd not sealed against writes, shrinking, growing "
                            "and new seals (seals %r, needs %d); not cached", nbytes, seals_of(fd), REQUIRED_SEALS)

    def _check_and_keep(self, key: bytes, nbytes: int, possession: bytes | None, fd: int) -> bool:
        if len(key) != KEY_BYTES or not self.wants(nbytes):
            return False
        if not is_sealed(fd):  # before the bytes are read: nobody can change them after the check
            return self._refuse_unsealed(nbytes, fd)
        if os.fstat(fd).st_size != nbytes:
            return self._refuse("an upload's memfd holds %d bytes, not the %d it names; not cached",
                                os.fstat(fd).st_size, nbytes)
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped, \
                memoryview(mapped) as view:
            kept = checked_possession(shared=self.shared, key=key, possession=possession, data=view)
        if kept is None:
            return self._refuse("an upload of %d bytes named a content key that does not name its bytes "
                                "(or its possession secret); not cached", nbytes)
        own = os.dup(fd)
        evicted: list[int] = []
        with self._lock:
            if (key, nbytes) in self._entries:  # the same bytes (the key names them): keep the entry
                self._entries.move_to_end((key, nbytes))
                evicted.append(own)
            else:
                while self._entries and (self.bytes + nbytes > self.max_bytes or len(self._entries) >= MAX_ENTRIES):
                    (_, old_n), old = self._entries.popitem(last=False)
                    self.bytes -= old_n
                    self.evicted += 1
                    evicted.append(old.fd)
                self._entries[(key, nbytes)] = _Entry(own, kept)
                self.bytes += nbytes
                self.inserted += 1
        for old_fd in evicted:
            os.close(old_fd)
        return True

    def clear(self) -> None:
        """Drop every entry (counters stay)."""
        with self._lock:
            fds = [e.fd for e in self._entries.values()]
            self._entries.clear()
            self.bytes = 0
        for fd in fds:
            os.close(fd)

    def entry_fds(self) -> list[int]:
        """The cache's own descriptors of its entries, oldest first (tests check their seals)."""
        with self._lock:
            return [e.fd for e in self._entries.values()]

    def stats(self) -> dict[str, int]:
        """Counters for /metrics, heartbeats and tests."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "bytes_saved": self.bytes_saved,
                    "inserted": self.inserted, "evicted": self.evicted, "refused": self.refused,
                    "pending": len(self._pending) + self._checking}
