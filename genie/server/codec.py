"""Decoding commands and encoding results for the executor.

Commands are decoded in two steps so that a bad handle or device is an error
*of that command*, not a malformed frame: msgpack decoding turns handle and
device tags into :class:`HandleRef` and :class:`DeviceRef` placeholders, then
:func:`resolve` swaps them for tensors from the store and the server's
devices. Structure checks raise :class:`~genie.errors.FrameError` (the
connection is then closed); resolution errors are reported to the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import torch

from genie.errors import FrameError, ProtocolError
from genie.wire.frame import unpack_body
from genie.wire.values import DTYPES, dtype_from_code, encode_common, make_ext_hook

#: Most dimensions a shape or stride may have.
MAX_DIMS = 64


@attrs.frozen
class HandleRef:
    """A tensor handle named in a command, not yet looked up."""

    handle: int


@attrs.frozen
class DeviceRef:
    """A device index named in a command, not yet looked up."""

    index: int


_EXT_HOOK = make_ext_hook(HandleRef, DeviceRef)


def decode(data: bytes) -> Any:
    """Decode one command (or a batch body) with handle and device placeholders."""
    return unpack_body(data, ext_hook=_EXT_HOOK)


def resolve(value: Any, tensor: Callable[[int], torch.Tensor], device: Callable[[int], torch.device]) -> Any:
    """Replace placeholders in nested lists/dicts with tensors and devices."""
    if isinstance(value, HandleRef):
        return tensor(value.handle)
    if isinstance(value, DeviceRef):
        return device(value.index)
    if isinstance(value, list):
        return [resolve(v, tensor, device) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, tensor, device) for k, v in value.items()}
    return value


def handles_in(value: Any) -> list[int]:
    """Every handle placeholder in a decoded value, in order."""
    if isinstance(value, HandleRef):
        return [value.handle]
    if isinstance(value, list):
        return [h for v in value for h in handles_in(v)]
    if isinstance(value, dict):
        return [h for v in value.values() for h in handles_in(v)]
    return []


# -- structure checks ---------------------------------------------------------------------------


def is_int(value: Any) -> bool:
    """True for ints that are not bools."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_handle(value: Any, what: str) -> int:
    """A handle from a command's structure (not a tagged value)."""
    if not is_int(value) or not 0 <= value < (1 << 63):
        raise FrameError(f"{what} must be a non-negative integer handle, got {value!r}")
    return value


def check_ints(value: Any, what: str, *, max_len: int = MAX_DIMS) -> list[int]:
    """A list of non-negative ints (a shape or strides)."""
    if not isinstance(value, list) or len(value) > max_len or not all(is_int(v) and v >= 0 for v in value):
        raise FrameError(f"{what} must be a list of at most {max_len} non-negative integers, got {value!r}")
    return value


def check_dtype(value: Any, what: str) -> torch.dtype:
    """A dtype code."""
    if not is_int(value) or not 0 <= value < len(DTYPES):
        raise FrameError(f"{what} must be a dtype code, got {value!r}")
    return dtype_from_code(value)


@attrs.frozen
class OutSpec:
    """What the client computed for one output: ``[handle, dtype code, shape, stride, storage offset]``."""

    handle: int
    dtype: torch.dtype
    shape: list[int]
    stride: list[int]
    offset: int

    @classmethod
    def parse(cls, value: Any) -> OutSpec:
        if not isinstance(value, list) or len(value) != 5:
            raise FrameError(f"an output spec must be [handle, dtype, shape, stride, offset], got {value!r}")
        handle = check_handle(value[0], "output handle")
        dtype = check_dtype(value[1], "output dtype")
        shape = check_ints(value[2], "output shape")
        stride = check_ints(value[3], "output stride")
        if len(stride) != len(shape):
            raise FrameError(f"output {handle} has shape {shape} but strides {stride}")
        if not is_int(value[4]) or value[4] < 0:
            raise FrameError(f"output {handle} has a bad storage offset {value[4]!r}")
        return cls(handle, dtype, shape, stride, value[4])

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def numel_of(shape: list[int]) -> int:
    """Elements of a shape."""
    n = 1
    for s in shape:
        n *= s
    return n


# -- results ------------------------------------------------------------------------------------


def describe(handle: int, t: torch.Tensor) -> list[Any]:
    """``[handle, dtype code, shape, stride, storage offset]`` of a stored tensor."""
    from genie.wire.values import dtype_code

    return [handle, dtype_code(t.dtype), list(t.shape), list(t.stride()), t.storage_offset()]


def encode_result(value: Any, tensor: Callable[[torch.Tensor], list[Any]]) -> Any:
    """A CALL result as plain msgpack values; ``tensor`` describes each tensor (storing it)."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, (list, tuple)):  # torch.Size is a tuple
        return [encode_result(v, tensor) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if encode_common(value) is not NotImplemented:
        return value
    raise ProtocolError(f"cannot send a result of type {type(value).__name__} to the client")


def pack_default(obj: Any) -> Any:
    """msgpack ``default`` for replies: dtypes, layouts, memory formats, complex."""
    encoded = encode_common(obj)
    if encoded is NotImplemented:
        raise TypeError(f"cannot encode {type(obj).__name__}")
    return encoded


def packb(obj: Any) -> bytes:
    """Pack a reply body."""
    return msgpack.packb(obj, use_bin_type=True, default=pack_default)
