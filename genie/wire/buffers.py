"""Zero-copy byte views of tensor memory (no numpy needed).

``tensor_bytes(t)`` gives a writable ``memoryview`` over a contiguous CPU
tensor's bytes, so frames go out from tensor memory and come in straight into
preallocated tensors. The view does not keep the tensor alive: callers hold the
tensor for as long as they use the view.
"""

from __future__ import annotations

import ctypes
import sys
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
_PAGE = 4096
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
_libc: Any = None


def prefault(t: torch.Tensor) -> None:
    """Fault in a large CPU tensor that is about to be filled (a receive) in one system call.

    A large allocation is new, untouched memory: filling it from a socket or a ring takes a
    page fault per 4 KiB page, and at 64 MiB those faults cost more than the copy itself (900
    MiB/s into fresh pages against 3 GiB/s into touched ones on the development machine).
    ``MADV_POPULATE_WRITE`` makes the kernel populate the whole range at once, without a trap
    per page. (``MADV_HUGEPAGE`` was faster still, but with THP's defrag in ``madvise`` mode it
    stalls some allocations for hundreds of milliseconds on compaction, so it is not used.)
    A best-effort hint: skipped silently where the platform or kernel refuses it.
    """
    global _libc
    nbytes = t.numel() * t.element_size()
    if nbytes < _MIN_ADVISED or not sys.platform.startswith("linux"):
        return
    start = (t.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
    end = (t.data_ptr() + nbytes) & ~(_PAGE - 1)
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if _libc and end > start:
        _libc.madvise(start, end - start, _MADV_POPULATE_WRITE)  # EINVAL before Linux 5.14: nothing changes
