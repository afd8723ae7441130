"""The per-session storage store: client storage ids to server storages, with quotas.

Storage ids are chosen by the client (its allocator hands them out without a
round trip) and live in that client's session only. Tensors are not kept:
commands describe tensors over storages and the executor builds them on the
fly, so views and aliasing hold because they share one storage here as they
do on the client.

Two bounds apply (0 means unbounded for bytes): the number of storages, live
or poisoned (``max_session_handles``), and the bytes of all storages
(``max_session_bytes``), each storage counted once at its current size.

A storage can be *poisoned*: the command that should have written it failed,
so it holds the root cause instead of bytes, and every later use names that
cause. A freed id is remembered (up to :data:`MAX_REMEMBERED_FREES`) so that a
late use says "freed" instead of silently getting a fresh zeroed storage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

import attrs
import torch

from genie.errors import ProtocolError, QuotaExceededError, RemoteExecutionError

log = logging.getLogger("genie.server.store")

#: Largest storage id accepted (ids are 63-bit msgpack integers).
MAX_STORAGE_ID = (1 << 63) - 1
#: Freed ids remembered per session for clearer errors; past this the record starts over.
MAX_REMEMBERED_FREES = 1 << 16


class StorageError(ProtocolError):
    """A command used a storage this session freed, or described it with another size.

    Defined here rather than in genie.errors because it never leaves the server:
    the executor turns it into a deferred error of kind ``storage``.
    """


def zeroed_storage(nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """A fresh storage of ``nbytes`` zero bytes: a session never sees bytes another session left behind."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device).untyped_storage()


def zero_from(storage: torch.UntypedStorage, start: int) -> None:
    """Zero a storage's bytes from ``start`` on (what resize_ grew is uninitialised memory)."""
    raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    raw[start:].zero_()


class StoreTables(NamedTuple):
    """The store's maps and quotas as the per-command fast path reads them (:mod:`genie.server.plans`).

    The maps are the store's own (never replaced, only emptied by :meth:`StorageStore.clear`). Readers
    only look; writes go through the store's methods. It is also what the native runner (genie._C_plans)
    binds once per session (genie.server.runner_api.RunnerBinding): it adopts and frees through these maps
    by the rules of :meth:`StorageStore.adopt` and :meth:`StorageStore.free` and reports the bytes that
    changed, which :meth:`StorageStore.count_native` counts.
    """

    storages: dict[int, torch.UntypedStorage]  #: live storages by id
    sizes: dict[int, int]  #: each live storage's counted size
    poisoned: dict[int, str]  #: poisoned ids and their causes
    freed: set[int]  #: freed ids remembered (at most MAX_REMEMBERED_FREES, then started over)
    max_storages: int  #: fixed when the store is made, as max_bytes
    max_bytes: int  #: 0: unbounded


@attrs.define
class StorageStore:
    """Storages by id for one session, with storage and byte quotas (``max_bytes`` 0: unbounded)."""

    max_storages: int = 1_000_000
    max_bytes: int = 0
    _storages: dict[int, torch.UntypedStorage] = attrs.field(factory=dict)
    _sizes: dict[int, int] = attrs.field(factory=dict)
    _poisoned: dict[int, str] = attrs.field(factory=dict)
    _freed: set[int] = attrs.field(factory=set)
    _bytes: int = 0
    _tables: StoreTables | None = attrs.field(default=None, init=False)

    # -- inspection -------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Live plus poisoned storages."""
        return len(self._storages) + len(self._poisoned)

    @property
    def bytes_used(self) -> int:
        """Bytes of every live storage."""
        return self._bytes

    @property
    def tables(self) -> StoreTables:
        """The maps and quotas for the per-command fast path (see :class:`StoreTables`)."""
        tables = self._tables
        if tables is None:
            tables = self._tables = StoreTables(self._storages, self._sizes, self._poisoned, self._freed,
                                                self.max_storages, self.max_bytes)
        return tables

    def seen(self, storage_id: int) -> bool:
        """Whether the session made, freed or had poisoned ``storage_id`` (an id a fresh output may not name)."""
        return storage_id in self._storages or storage_id in self._poisoned or storage_id in self._freed

    def count_native(self, grown: int) -> None:
        """Count ``grown`` bytes (negative: released) that the native runner adopted or freed through
        :attr:`tables` by :meth:`adopt`'s and :meth:`free`'s rules."""
        self._bytes += grown

    def bytes_by_device(self) -> dict[str, int]:
        """Bytes of the live storages per device (``cuda:0``, ``cpu``); safe beside the session thread."""
        out: dict[str, int] = {}
        for storage in list(self._storages.values()):  # one C-level copy
            key = str(storage.device)
            out[key] = out.get(key, 0) + storage.nbytes()
        return out

    def stats(self) -> dict[str, int]:
        """Counts for logs and tests."""
        return {
            "storages": len(self._storages),
            "poisoned": len(self._poisoned),
            "bytes": self._bytes,
        }

    def __contains__(self, storage_id: object) -> bool:
        return storage_id in self._storages

    def nbytes(self, storage_id: int) -> int:
        """The current size of a live storage."""
        return self._sizes[storage_id]

    # -- use --------------------------------------------------------------------------------

    def get(self, storage_id: int) -> torch.UntypedStorage | None:
        """The live storage ``storage_id``; None if never seen; StorageError/RemoteExecutionError if freed/poisoned."""
        storage = self._storages.get(storage_id)
        if storage is not None:
            return storage
        self.check_usable(storage_id)
        return None

    def check_usable(self, storage_id: int) -> None:
        """Raise if ``storage_id`` is poisoned or was freed (a never-seen id is usable: it will be made)."""
        cause = self._poisoned.get(storage_id)
        if cause is not None:
            raise RemoteExecutionError(f"storage {storage_id} holds nothing because an earlier command failed: {cause}")
        if storage_id in self._freed:
            raise StorageError(f"storage {storage_id} was freed earlier in this session; storage ids are never reused")

    def check_room(self, storages: int, nbytes: int = 0) -> None:
        """Raise QuotaExceededError unless ``storages`` more storages and ``nbytes`` more bytes fit."""
        if self.count + storages > self.max_storages:
            raise QuotaExceededError(
                f"session storage limit reached: {self.count} storages in use, {storages} more requested, "
                f"limit {self.max_storages} (max_session_handles); free tensors you no longer need"
            )
        if self.max_bytes and nbytes > 0 and self._bytes + nbytes > self.max_bytes:
            raise QuotaExceededError(
                f"session memory limit reached: {self._bytes} bytes in use, {nbytes} more requested, "
                f"limit {self.max_bytes} (max_session_bytes); free tensors you no longer need"
            )

    def put(self, storage_id: int, storage: torch.UntypedStorage) -> None:
        """Keep ``storage`` under a new id, counting its bytes against the quotas."""
        self._check_id(storage_id)
        if storage_id in self._storages:
            raise ProtocolError(f"storage {storage_id} already exists in this session; storage ids are never reused")
        nbytes = storage.nbytes()
        self.check_room(1, nbytes)
        self._poisoned.pop(storage_id, None)
        self._storages[storage_id] = storage
        self._sizes[storage_id] = nbytes
        self._bytes += nbytes

    def adopt(self, storage_id: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        """:meth:`put` for the per-command path (genie.server.plans): ``storage`` of ``nbytes`` under an id the
        session does not hold; the same checks, in a few comparisons when they pass (:meth:`put` raises
        its errors when they do not)."""
        if not 0 < storage_id <= MAX_STORAGE_ID or len(self._storages) + len(self._poisoned) >= self.max_storages \
                or self.max_bytes and self._bytes + nbytes > self.max_bytes or storage_id in self._storages:
            self.put(storage_id, storage)
            return
        if self._poisoned:
            self._poisoned.pop(storage_id, None)
        self._storages[storage_id] = storage
        self._sizes[storage_id] = nbytes
        self._bytes += nbytes

    def make(self, storage_id: int, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """A new zero-filled storage under ``storage_id`` (quota checked before allocating)."""
        self._check_id(storage_id)
        self.check_usable(storage_id)
        self.check_room(1, nbytes)
        storage = zeroed_storage(nbytes, device)
        self.put(storage_id, storage)
        return storage

    def resized(self, storage_id: int) -> None:
        """Account for a storage that changed size in place (``resize_``, ``set_``, an ``out=`` argument).

        Growth past ``max_bytes`` is refused here too, whatever path grew it (the pre-flight refuses it before
        an op runs; this is the store's own bound): the storage is poisoned, so the session holds neither it
        nor its memory once the command's tensors are gone, and QuotaExceededError is raised.
        """
        storage = self._storages.get(storage_id)
        if storage is None:
            return
        now = storage.nbytes()
        grown = now - self._sizes[storage_id]
        if grown > 0 and self.max_bytes and self._bytes + grown > self.max_bytes:
            message = (f"storage {storage_id} grew in place by {grown} bytes to {now}, past this session's limit: "
                       f"{self._bytes} bytes were in use, limit {self.max_bytes} (max_session_bytes); free tensors "
                       "you no longer need")
            self.poison(storage_id, message)
            raise QuotaExceededError(message)
        self._bytes += grown
        self._sizes[storage_id] = now

    def poison(self, storage_id: int, cause: str) -> None:
        """Mark ``storage_id`` as the output of a failed command; later uses report ``cause``.

        A live storage is dropped; the storage quota is not checked, so a failure
        can always be recorded (poisoned entries still count towards it afterwards).
        """
        if not isinstance(storage_id, int) or isinstance(storage_id, bool) or not 0 < storage_id <= MAX_STORAGE_ID:
            return
        self._drop(storage_id)
        self._poisoned[storage_id] = cause

    def free(self, storage_ids: Iterable[int],
             recycle: Callable[[torch.UntypedStorage], None] | None = None) -> int:
        """Release storages (unknown ids are ignored); returns how many were released.

        ``recycle`` is offered each released live storage (the session's staging pool reuses
        the memory of those nothing else references for later uploads).
        """
        released = 0
        for storage_id in storage_ids:
            storage = self._storages.get(storage_id)
            if self._drop(storage_id) or self._poisoned.pop(storage_id, None) is not None:
                if storage is not None and recycle is not None:
                    recycle(storage)
                    storage = None
                released += 1
                if len(self._freed) >= MAX_REMEMBERED_FREES:
                    self._freed.clear()  # bounded memory; only the wording of a late use's error is lost
                self._freed.add(storage_id)
        return released

    def clear(self) -> dict[str, int]:
        """Release everything; returns the stats from just before."""
        before = self.stats()
        self._storages.clear()
        self._sizes.clear()
        self._poisoned.clear()
        self._freed.clear()
        self._bytes = 0
        return before

    # -- internals --------------------------------------------------------------------------

    @staticmethod
    def _check_id(storage_id: int) -> None:
        if not isinstance(storage_id, int) or isinstance(storage_id, bool) or not 0 < storage_id <= MAX_STORAGE_ID:
            raise ProtocolError(f"storage id must be an integer from 1 to {MAX_STORAGE_ID}, got {storage_id!r}")

    def _drop(self, storage_id: int) -> bool:
        if self._storages.pop(storage_id, None) is None:
            return False
        self._bytes -= self._sizes.pop(storage_id)
        return True
