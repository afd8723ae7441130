"""Zero-copy byte views of tensor memory (no numpy needed).

``tensor_bytes(t)`` gives a writable ``memoryview`` over a contiguous CPU
tensor's bytes, so frames go out from tensor memory and come in straight into
preallocated tensors. The view does not keep the tensor alive: callers hold the
tensor for as long as they use the view.
"""

from __future__ import annotations

import ctypes

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
