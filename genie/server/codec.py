"""Decoding commands and encoding results for the executor.

Commands are decoded in two steps so that a bad storage or device is an error
*of that command*, not a malformed frame: msgpack decoding turns tensor,
device and generator tags into :class:`Descriptor`, :class:`DeviceRef` and
:class:`GeneratorRef` placeholders, then :func:`resolve` swaps them for
tensors over the session's storages, the server's devices and the session's
generators. Structure checks (wrong types, a descriptor that is not a list of
six) raise :class:`~genie.errors.FrameError` (the connection is then closed);
bounds checks against storages (:meth:`Descriptor.check`) raise
:class:`~genie.errors.ProtocolError`, reported to the client as that command's
error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import torch

from genie.errors import FrameError, ProtocolError
from genie.server.store import StorageError
from genie.wire.frame import unpack_body
from genie.wire.spec import is_int as is_int  # the server's modules take it from here
from genie.wire.values import (
    DTYPES,
    EXT_INLINE_TENSOR,
    MAX_INLINE_TENSOR_BYTES,
    dtype_code,
    dtype_from_code,
    encode_common,
    make_ext_hook,
    unpack_descriptor,
)

_tensor_over: Any
try:  # genie/csrc/server/graph_program.cpp; without the extension Descriptor.over makes the tensor in Python
    from genie._C_plans import tensor_over as _tensor_over
except ImportError:  # pragma: no cover - an install that did not build the extension
    _tensor_over = None

#: Most dimensions a shape or stride may have.
MAX_DIMS = 64
#: Largest storage id (63 bits) and largest storage size accepted in a descriptor.
MAX_ID = (1 << 63) - 1
MAX_NBYTES = 1 << 62


@attrs.frozen
class DeviceRef:
    """A device index named in a command, not yet looked up."""

    index: int


@attrs.frozen
class GeneratorRef:
    """A session generator id named in a command (0: the device's default), not yet looked up."""

    generator_id: int


def _valid_ints(values: Any) -> bool:
    # type() is int, not isinstance: bools are ints to isinstance. A plain loop: this runs for every tensor.
    if type(values) is not list or len(values) > MAX_DIMS:
        return False
    for v in values:
        if type(v) is not int or v < 0 or v > MAX_NBYTES:
            return False
    return True


class Descriptor:
    """A tensor over one of the session's storages: ``[storage_id, dtype, sizes, strides, offset, storage_nbytes]``.

    A plain slotted class, not attrs: one is parsed for every tensor of every command.
    """

    __slots__ = ("dtype", "extent", "numel", "offset", "sizes", "span", "storage_id", "storage_nbytes", "strides")

    def __init__(self, storage_id: int, dtype: torch.dtype, sizes: tuple[int, ...], strides: tuple[int, ...],
                 offset: int, storage_nbytes: int) -> None:
        self.storage_id = storage_id
        self.dtype = dtype
        self.sizes = sizes
        self.strides = strides
        self.offset = offset
        self.storage_nbytes = storage_nbytes
        numel, last, extent = 1, offset, 1
        for n, st in zip(sizes, strides, strict=False):  # same lengths: checked by parse
            numel *= n
            last += (n - 1) * st
            extent *= n or 1
        self.numel = numel
        #: The element count ignoring zero sizes: torch refuses (int64 overflow) shapes past 2**63 even when empty.
        self.extent = extent
        #: Bytes from the storage's start to the end of the last element (0 for an empty tensor).
        self.span = 0 if numel == 0 else (last + 1) * dtype.itemsize

    def with_id(self, storage_id: int) -> Descriptor:
        """The same layout over another storage (its id already checked)."""
        d = _new_descriptor(Descriptor)
        d.storage_id = storage_id
        d.dtype, d.sizes, d.strides, d.offset = self.dtype, self.sizes, self.strides, self.offset
        d.storage_nbytes, d.numel, d.extent, d.span = self.storage_nbytes, self.numel, self.extent, self.span
        return d

    def __repr__(self) -> str:
        return (f"Descriptor({self.storage_id}, {self.dtype}, {list(self.sizes)}, {list(self.strides)}, "
                f"{self.offset}, {self.storage_nbytes})")

    @classmethod
    def parse(cls, value: Any, what: str = "tensor descriptor") -> Descriptor:
        """Check the structure (types, signs, at most 64 dims); FrameError if malformed."""
        if type(value) is list and len(value) == 6:
            storage_id, code, sizes, strides, offset, nbytes = value
            if (type(storage_id) is int and 0 <= storage_id <= MAX_ID and type(code) is int
                    and 0 <= code < len(DTYPES) and DTYPES[code] is not None
                    and type(offset) is int and 0 <= offset <= MAX_NBYTES
                    and type(nbytes) is int and 0 <= nbytes <= MAX_NBYTES
                    and _valid_ints(sizes) and _valid_ints(strides) and len(sizes) == len(strides)):
                return cls(storage_id, DTYPES[code], tuple(sizes), tuple(strides), offset, nbytes)
        cls._explain(value, what)
        raise AssertionError("unreachable: _explain raises")

    @staticmethod
    def _explain(value: Any, what: str) -> None:
        """Raise the FrameError that says what is wrong with a descriptor that failed the fast check."""
        if not isinstance(value, list) or len(value) != 6:
            raise FrameError(f"a {what} must be [storage_id, dtype, sizes, strides, offset, storage_nbytes], "
                             f"got {_preview(value)}")
        storage_id = check_id(value[0], f"{what} storage id")
        check_dtype(value[1], f"{what} dtype")
        sizes = check_ints(value[2], f"{what} sizes")
        strides = check_ints(value[3], f"{what} strides")
        if len(strides) != len(sizes):
            raise FrameError(f"{what} of storage {storage_id} has {len(sizes)} sizes but {len(strides)} strides")
        if not is_int(value[4]) or not 0 <= value[4] <= MAX_NBYTES:
            raise FrameError(f"{what} of storage {storage_id} has a bad storage offset {_preview(value[4])}")
        raise FrameError(f"{what} of storage {storage_id} has a bad storage_nbytes {_preview(value[5])}")

    def check(self, actual_nbytes: int | None) -> None:
        """ProtocolError unless the tensor lies inside ``storage_nbytes`` (and that equals ``actual_nbytes``)."""
        if self.span > self.storage_nbytes:
            raise ProtocolError(
                f"tensor of sizes {list(self.sizes)}, strides {list(self.strides)} and offset {self.offset} "
                f"({self.dtype}) reaches byte {self.span} of storage {self.storage_id}, which has "
                f"{self.storage_nbytes}")
        if self.extent > MAX_NBYTES:
            raise ProtocolError(f"tensor of sizes {list(self.sizes)} over storage {self.storage_id} has more than "
                                "2**62 elements")
        if self.storage_id == 0 and self.storage_nbytes != 0:
            raise ProtocolError(f"storage id 0 means an empty storage, but the descriptor says {self.storage_nbytes} "
                                "bytes")
        if actual_nbytes is not None and actual_nbytes != self.storage_nbytes:
            raise StorageError(f"storage {self.storage_id} has {actual_nbytes} bytes on the server but the client "
                               f"described it with {self.storage_nbytes}; resize it with CMD_RESIZE first")

    def over(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """The described tensor over ``storage`` (bounds already checked)."""
        if _tensor_over is not None:  # the same in one C++ call (a replay resolves a hundred inputs)
            return _tensor_over(storage, self.dtype, self.offset, self.sizes, self.strides)
        t = torch.empty(0, dtype=self.dtype, device=storage.device)
        return t.set_(storage, self.offset, self.sizes, self.strides)

    def matches(self, t: torch.Tensor) -> bool:
        """True when ``t`` has exactly this dtype, sizes, strides and offset."""
        return (t.dtype == self.dtype and t.shape == self.sizes and t.stride() == self.strides
                and t.storage_offset() == self.offset)


_new_descriptor = object.__new__


def _tensor_tag(value: Any) -> Descriptor:
    return Descriptor.parse(value)


#: Checked descriptor layouts: the msgpack bytes after the storage id -> a descriptor with that layout.
_layouts: dict[bytes, Descriptor] = {}
#: Most layouts kept (a client sending endless new shapes only empties the cache).
MAX_LAYOUTS = 4096
#: Byte length of a msgpack unsigned int by its first byte (fixint: 1; uint8/16/32/64: 2, 3, 5, 9).
_UINT_LENGTH = {0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9}


def _tensor_from_bytes(data: bytes) -> Descriptor | None:
    """A tensor tag's descriptor from its raw msgpack, when its layout was checked before; else None.

    A descriptor is ``[storage_id, dtype, sizes, strides, offset, storage_nbytes]``: everything after the
    storage id repeats from op to op while the id changes (a fresh output per op). A payload whose bytes
    after a well-formed unsigned storage id equal a layout :meth:`Descriptor.parse` accepted is that
    layout over the new id, so it skips the msgpack decode and the checks; anything else (a new layout,
    a malformed payload) returns None and takes the full path, which caches it when it is valid.
    """
    if len(data) < 3 or data[0] != 0x96:  # a fixarray of 6
        return None
    first = data[1]
    if first < 0x80:
        end, storage_id = 2, first
    else:
        n = _UINT_LENGTH.get(first)
        if n is None:
            return None
        end = 1 + n
        storage_id = int.from_bytes(data[2:end], "big")
        if storage_id > MAX_ID:
            return None
    layout = _layouts.get(data[end:])
    if layout is None:
        desc = Descriptor.parse(unpack_descriptor(data))
        if len(_layouts) >= MAX_LAYOUTS:
            _layouts.clear()
        _layouts[data[end:]] = desc
        return desc
    return layout.with_id(storage_id)


_WIRE_HOOK = make_ext_hook(_tensor_tag, DeviceRef, GeneratorRef, _tensor_from_bytes)
#: Bounds on an inline tensor's msgpack ``[dtype, shape, raw]``: a shape of at most 64 sizes, the bytes the
#: protocol allows inline (:data:`~genie.wire.values.MAX_INLINE_TENSOR_BYTES`).
_INLINE_LIMITS = {"max_array_len": MAX_DIMS, "max_map_len": 0, "max_str_len": 0,
                  "max_bin_len": MAX_INLINE_TENSOR_BYTES, "max_ext_len": 0}


def check_inline(data: bytes) -> None:
    """FrameError unless an inline tensor's payload keeps the bounds of every other tensor: at most 64 dimensions,
    sizes of at most 2**62 (an empty one too: torch refuses more than 2**63 elements even when one size is 0),
    at most :data:`~genie.wire.values.MAX_INLINE_TENSOR_BYTES` bytes. One of 500,001 dimensions was accepted
    (issue 28); the decoder itself bounds only its bytes."""
    try:
        value = msgpack.unpackb(data, raw=False, **_INLINE_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types on garbage, ValueError past a limit
        raise FrameError(f"malformed inline tensor (at most {MAX_DIMS} dimensions and {MAX_INLINE_TENSOR_BYTES} "
                         f"bytes): {type(exc).__name__}: {exc}") from None
    if type(value) is not list or len(value) != 3 or not _valid_ints(value[1]):
        raise FrameError(f"an inline tensor must be [dtype code, shape of at most {MAX_DIMS} sizes, raw bytes], got "
                         f"{_preview(value)}")
    extent = 1
    for size in value[1]:
        extent *= size or 1
    if extent > MAX_NBYTES:
        raise FrameError(f"inline tensor of shape {value[1]} has more than 2**62 elements")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_INLINE_TENSOR:
        check_inline(data)
    return _WIRE_HOOK(code, data)


_EXT_HOOK = _ext_hook


#: Types resolve() must look into or replace.
_NESTED = frozenset({list, dict, Descriptor, DeviceRef, GeneratorRef})


def decode(data: bytes | bytearray) -> Any:
    """Decode one command (or a batch body) with descriptor, device and generator placeholders."""
    return unpack_body(data, ext_hook=_EXT_HOOK)


def resolve(value: Any, tensor: Callable[[Descriptor], torch.Tensor], device: Callable[[int], torch.device],
            generator: Callable[[int], torch.Generator]) -> Any:
    """Replace placeholders in nested lists/dicts with tensors, devices and generators."""
    kind = type(value)
    if kind is Descriptor:
        return tensor(value)
    if kind is list:
        # Scalars (most arguments) are kept without a call: this runs for every command.
        return [resolve(v, tensor, device, generator) if type(v) in _NESTED else v for v in value]
    if kind is dict:
        return {k: resolve(v, tensor, device, generator) if type(v) in _NESTED else v for k, v in value.items()}
    if kind is DeviceRef:
        return device(value.index)
    if kind is GeneratorRef:
        return generator(value.generator_id)
    return value


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def preview(value: Any) -> str:
    """A received value's repr cut to 80 characters, for error messages."""
    return _preview(value)


# -- structure checks ---------------------------------------------------------------------------


def check_id(value: Any, what: str) -> int:
    """A storage id from a command's structure (0 allowed: the empty storage)."""
    if not is_int(value) or not 0 <= value <= MAX_ID:
        raise FrameError(f"{what} must be an integer from 0 to 2**63-1, got {_preview(value)}")
    return value


def check_ints(value: Any, what: str, *, max_len: int = MAX_DIMS) -> list[int]:
    """A list of non-negative ints (a shape or strides), each at most 2**62."""
    if not isinstance(value, list) or len(value) > max_len or not all(
            is_int(v) and 0 <= v <= MAX_NBYTES for v in value):
        raise FrameError(f"{what} must be a list of at most {max_len} non-negative integers, got {_preview(value)}")
    return value


def check_dtype(value: Any, what: str) -> torch.dtype:
    """A dtype code."""
    if not is_int(value) or not 0 <= value < len(DTYPES):
        raise FrameError(f"{what} must be a dtype code, got {_preview(value)}")
    return dtype_from_code(value)


def numel_of(shape: list[int] | tuple[int, ...]) -> int:
    """Elements of a shape."""
    n = 1
    for s in shape:
        n *= s
    return n


# -- results ------------------------------------------------------------------------------------


def describe(storage_id: int, t: torch.Tensor) -> list[Any]:
    """``[storage_id, dtype code, sizes, strides, offset, storage_nbytes]`` of a stored tensor."""
    return [storage_id, dtype_code(t.dtype), list(t.shape), list(t.stride()), t.storage_offset(),
            t.untyped_storage().nbytes()]


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
