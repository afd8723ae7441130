"""The op clock: a few bytes of memory shared by a session worker and the node, read for deadlines.

The worker writes, before each op, the op's name and the monotonic time it started, and
zero when it ends; the node's supervisor reads them to kill a worker whose op runs past
``op_deadline``. A write is a ``struct.pack_into`` on a shared page (well under a
microsecond), where a message per op over a pipe would cost tens: the clock is on the
hot path of every op. ``CLOCK_MONOTONIC`` is one clock for every process of a host, so
the two sides compare times directly.

The page is a ``memfd`` of its own per worker (never a shared arena): a worker that went
wrong can scribble only on its own clock, and the worst it can do then is get itself killed
or escape the deadline, which is its own session's business.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from multiprocessing import reduction
from typing import Any

#: started_ns (0: no op running), then the op's name (UTF-8, NUL-padded).
_LAYOUT = struct.Struct("<q96s")
_STARTED = struct.Struct("<q")


class OpClock:
    """One worker's clock; :meth:`begin`/:meth:`end` in the worker, :meth:`running` in the node."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("genie-op-clock", os.MFD_CLOEXEC)
            os.ftruncate(fd, mmap.PAGESIZE)
        self._fd = fd
        self._map = mmap.mmap(fd, mmap.PAGESIZE)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._map)  # holds the address below

    def __reduce__(self) -> Any:
        # Crosses to a worker while it is being started (multiprocessing's DupFd sends the fd along).
        return _rebuild, (reduction.DupFd(self._fd),)

    def begin(self, label: str) -> None:
        """An op starts (the worker)."""
        _LAYOUT.pack_into(self._map, 0, time.monotonic_ns(), label.encode("utf-8", "replace")[:96])

    def end(self) -> None:
        """The op ended, however (the worker)."""
        _STARTED.pack_into(self._map, 0, 0)

    def running(self) -> tuple[str, float] | None:
        """``(op, seconds it has run)`` while an op runs, else None (the node)."""
        started, raw = _LAYOUT.unpack_from(self._map, 0)
        if started <= 0:
            return None
        return raw.rstrip(b"\0").decode("utf-8", "replace") or "?", max(0.0, (time.monotonic_ns() - started) / 1e9)

    @property
    def address(self) -> int:
        """Where the page is mapped in this process: the native plan runner (genie._C_plans) writes the same
        layout there (0 once closed)."""
        return ctypes.addressof(self._anchor) if self._anchor is not None else 0

    def close(self) -> None:
        """Unmap and close the page."""
        self._anchor = None  # the map cannot close while a pointer into it exists
        self._map.close()
        os.close(self._fd)


def _rebuild(dup: Any) -> OpClock:
    return OpClock(dup.detach())


class NullClock:
    """What an executor times its ops with when no supervisor watches (sessions in threads)."""

    address = 0  #: no page: the native plan runner writes no clock

    def begin(self, label: str) -> None:
        return

    def end(self) -> None:
        return


NULL_CLOCK = NullClock()
