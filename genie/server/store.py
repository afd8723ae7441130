"""The per-session tensor store: client handles to server tensors, with quotas.

Handles are chosen by the client (so ops can be sent fire-and-forget) and live
in that client's session only. The store counts memory per *storage*: views of
one tensor share a storage and are counted once, and a storage's bytes are
released when its last handle goes. Two bounds apply (0 means unbounded for
bytes): the number of handles, live or poisoned, and the bytes of all
storages.

A handle can be *poisoned*: the op that should have produced it failed, so it
holds the root cause instead of a tensor, and every later use names that cause.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import attrs
import torch

from genie.errors import ProtocolError, QuotaExceededError, RemoteExecutionError

log = logging.getLogger("genie.server.store")

#: Largest handle value accepted (handles are msgpack integers).
MAX_HANDLE = (1 << 63) - 1


class UnknownHandleError(ProtocolError):
    """A command used a handle this session never made or already freed.

    Defined here rather than in genie.errors because it never leaves the server:
    the executor turns it into a deferred error for the client.
    """


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl's address: stable across resize_ (unlike data_ptr), shared by views.
    return t.untyped_storage()._cdata


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@attrs.define
class _StorageUse:
    nbytes: int
    handles: int


@attrs.define
class TensorStore:
    """Handles to tensors for one session, with handle and byte quotas (``max_bytes`` 0: unbounded)."""

    max_handles: int = 1_000_000
    max_bytes: int = 0
    _tensors: dict[int, torch.Tensor] = attrs.field(factory=dict)
    _keys: dict[int, int] = attrs.field(factory=dict)
    _poisoned: dict[int, str] = attrs.field(factory=dict)
    _storages: dict[int, _StorageUse] = attrs.field(factory=dict)
    _bytes: int = 0

    # -- inspection -------------------------------------------------------------------------

    @property
    def handle_count(self) -> int:
        """Live plus poisoned handles."""
        return len(self._tensors) + len(self._poisoned)

    @property
    def bytes_used(self) -> int:
        """Bytes of every storage some handle refers to, each storage counted once."""
        return self._bytes

    def stats(self) -> dict[str, int]:
        """Counts for logs and tests."""
        return {
            "handles": len(self._tensors),
            "poisoned": len(self._poisoned),
            "storages": len(self._storages),
            "bytes": self._bytes,
        }

    def __contains__(self, handle: object) -> bool:
        return handle in self._tensors or handle in self._poisoned

    # -- use --------------------------------------------------------------------------------

    def get(self, handle: int) -> torch.Tensor:
        """The tensor behind ``handle``; RemoteExecutionError naming the root cause if poisoned."""
        tensor = self._tensors.get(handle)
        if tensor is not None:
            return tensor
        cause = self._poisoned.get(handle)
        if cause is not None:
            raise RemoteExecutionError(f"handle {handle} holds no tensor because an earlier op failed: {cause}")
        raise UnknownHandleError(f"handle {handle} is unknown in this session (never created, or already freed)")

    def check_room(self, handles: int, nbytes: int = 0) -> None:
        """Raise QuotaExceededError unless ``handles`` more handles and ``nbytes`` more bytes fit."""
        if self.handle_count + handles > self.max_handles:
            raise QuotaExceededError(
                f"session handle limit reached: {self.handle_count} handles in use, {handles} more requested, "
                f"limit {self.max_handles} (max_session_handles); free tensors you no longer need"
            )
        if self.max_bytes and self._bytes + nbytes > self.max_bytes:
            raise QuotaExceededError(
                f"session memory limit reached: {self._bytes} bytes in use, {nbytes} more requested, "
                f"limit {self.max_bytes} (max_session_bytes); free tensors you no longer need"
            )

    def put(self, handle: int, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under a new ``handle``, counting its storage once."""
        self._check_new(handle)
        self.check_room(1)
        key = _storage_key(tensor)
        use = self._storages.get(key)
        if use is None:
            nbytes = _storage_nbytes(tensor)
            self.check_room(0, nbytes)
            self._storages[key] = _StorageUse(nbytes, 1)
            self._bytes += nbytes
        else:
            use.handles += 1
        self._tensors[handle] = tensor
        self._keys[handle] = key

    def poison(self, handle: int, cause: str) -> None:
        """Mark ``handle`` as the output of a failed op; later uses report ``cause``.

        A handle that already holds a tensor is replaced; the handle quota is not
        checked, so a failure can always be recorded.
        """
        if not isinstance(handle, int) or isinstance(handle, bool) or not 0 <= handle <= MAX_HANDLE:
            return
        if handle in self._tensors:
            self._drop(handle)
        self._poisoned[handle] = cause

    def recount(self) -> None:
        """Rebuild the storage accounting from the tensors held.

        Run after ops that resize a storage in place or point a tensor at another
        storage (``resize_``, ``set_``): sizes and storage identities may have changed.
        The quota is not enforced here; the next allocation sees the new total.
        """
        self._storages.clear()
        self._bytes = 0
        for handle, tensor in self._tensors.items():
            key = _storage_key(tensor)
            self._keys[handle] = key
            use = self._storages.get(key)
            if use is None:
                nbytes = _storage_nbytes(tensor)
                self._storages[key] = _StorageUse(nbytes, 1)
                self._bytes += nbytes
            else:
                use.handles += 1

    def free(self, handles: Iterable[int]) -> int:
        """Release handles (unknown ones are ignored); returns how many were released."""
        released = 0
        for handle in handles:
            if handle in self._tensors:
                self._drop(handle)
                released += 1
            elif self._poisoned.pop(handle, None) is not None:
                released += 1
        return released

    def clear(self) -> dict[str, int]:
        """Release everything; returns the stats from just before."""
        before = self.stats()
        self._tensors.clear()
        self._keys.clear()
        self._poisoned.clear()
        self._storages.clear()
        self._bytes = 0
        return before

    # -- internals --------------------------------------------------------------------------

    def _check_new(self, handle: int) -> None:
        if not isinstance(handle, int) or isinstance(handle, bool) or not 0 <= handle <= MAX_HANDLE:
            raise ProtocolError(f"handle must be an integer from 0 to {MAX_HANDLE}, got {handle!r}")
        if handle in self._tensors:
            raise ProtocolError(f"handle {handle} is already in use in this session; free it before reusing it")
        self._poisoned.pop(handle, None)

    def _drop(self, handle: int) -> None:
        del self._tensors[handle]
        key = self._keys.pop(handle)
        use = self._storages[key]
        use.handles -= 1
        if use.handles == 0:
            del self._storages[key]
            self._bytes -= use.nbytes
