"""Zero-copy byte views of tensor memory (no numpy needed).

``tensor_bytes(t)`` gives a writable ``memoryview`` over a contiguous CPU
tensor's bytes, so frames go out from tensor memory and come in straight into
preallocated tensors. The view does not keep the tensor alive: callers hold the
tensor for as long as they use the view.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (empty for empty tensors)."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")



#: Smaller buffers are not worth a system call.
_MIN_ADVISED = 4 << 20
#: Buffers at least this large are populated by a helper thread while the receive fills them (populated_ahead).
_MIN_AHEAD = 32 << 20
#: Bytes the helper populates per system call: small enough that it stops soon after the receive ends.
_AHEAD_CHUNK = 4 << 20
_PAGE = 4096
#: mincore's bytes to their bit 0 (the only defined one)
_LOW_BIT = bytes(b & 1 for b in range(256))
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
_libc: Any = None


def _system() -> Any:
    """libc with madvise and mincore typed, or False where it cannot be loaded."""
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)  # CDLL: calls release the GIL
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc


def _pages(t: torch.Tensor) -> tuple[int, int]:
    """The whole pages of ``t``'s bytes, as (start, end) addresses; (0, 0) when it is not worth advising."""
    nbytes = t.numel() * t.element_size()
    if nbytes < _MIN_ADVISED or not sys.platform.startswith("linux") or t.device.type != "cpu":
        return 0, 0
    start = (t.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
    end = (t.data_ptr() + nbytes) & ~(_PAGE - 1)
    return (start, end) if end > start else (0, 0)


def resident(t: torch.Tensor) -> bool:
    """Whether every whole page of a large CPU tensor is already in memory (``mincore``); False where unknown.

    A buffer the program reuses (a preallocated destination, a pooled block) is resident: populating it
    again walks every page for nothing (9-18 ms for 256 MiB on the development machine, against 0.2 ms for
    this check). Small tensors answer False (nobody advises them)."""
    start, end = _pages(t)
    libc: Any = _system() if end else False
    if not libc:
        return False
    vec = (ctypes.c_ubyte * ((end - start) // _PAGE))()
    if libc.mincore(start, end - start, vec) != 0:
        return False
    return b"\0" not in bytes(vec).translate(_LOW_BIT)  # bit 0: resident; the others are reserved


def prefault(t: torch.Tensor) -> None:
    """Fault in a large CPU tensor that is about to be filled (a receive) in one system call.

    A large allocation is new, untouched memory: filling it from a socket or a ring takes a
    page fault per 4 KiB page, and at 64 MiB those faults cost more than the copy itself (900
    MiB/s into fresh pages against 3 GiB/s into touched ones on the development machine).
    ``MADV_POPULATE_WRITE`` makes the kernel populate the whole range at once, without a trap
    per page. (``MADV_HUGEPAGE`` was faster still, but with THP's defrag in ``madvise`` mode it
    stalls some allocations for hundreds of milliseconds on compaction, so it is not used.)
    Memory already resident (:func:`resident`) is left alone. A best-effort hint: skipped
    silently where the platform or kernel refuses it.
    """
    start, end = _pages(t)
    libc: Any = _system() if end else False
    if libc and not resident(t):
        libc.madvise(start, end - start, _MADV_POPULATE_WRITE)  # EINVAL before Linux 5.14: nothing changes


def _populate(ranges: list[tuple[int, int]], stop: threading.Event) -> None:
    libc = _system()
    for start, end in ranges:
        for at in range(start, end, _AHEAD_CHUNK):
            if stop.is_set():
                return
            libc.madvise(at, min(_AHEAD_CHUNK, end - at), _MADV_POPULATE_WRITE)


@contextlib.contextmanager
def populated_ahead(*tensors: torch.Tensor) -> Iterator[None]:
    """Populate large fresh CPU tensors' pages while the ``with`` body receives into them, in order.

    The kernel's page population (allocate and zero each 4 KiB page: about 75 ms for 256 MiB here) is
    work a receive cannot skip when its destination is new memory (``.cpu()``'s fresh result, a new
    upload storage). A helper thread populates front to back, :data:`_AHEAD_CHUNK` at a time, while the
    receive's copy follows behind it; a page the receive reaches first is faulted in by the receive
    itself (both write the same anonymous page: the contents are the receive's either way). With a
    free core the population costs little wall time; without one, about what :func:`prefault` costs.
    Resident tensors (:func:`resident`) are skipped; when less than :data:`_MIN_AHEAD` is left to
    populate, it is populated at once, as :func:`prefault` does. The helper stops when the ``with``
    block ends, on an exception too.
    """
    libc: Any = _system() if tensors else False
    ranges = [_pages(t) for t in tensors if _pages(t)[1] and not resident(t)] if libc else []
    if sum(end - start for start, end in ranges) < _MIN_AHEAD:
        for start, end in ranges:
            libc.madvise(start, end - start, _MADV_POPULATE_WRITE)
        yield
        return
    stop = threading.Event()
    helper = threading.Thread(target=_populate, args=(ranges, stop), name="genie-populate", daemon=True)
    helper.start()
    try:
        yield
    finally:
        stop.set()
        helper.join()
