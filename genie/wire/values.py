"""Tagged values: how op arguments cross the wire without pickle.

Plain msgpack carries None, bools, ints, floats, strings and lists; everything else is a msgpack
extension type whose code is :mod:`genie.wire.spec`'s, decoded only into the small set of objects
below; nothing received is ever used to look up an attribute. What each tag carries:
docs/protocol.md, "Tagged values". The receiver decides what a tensor or generator tag means (the
server checks every bound of a tensor descriptor against its own storages, see
:mod:`genie.server.codec`); this module only moves the values.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import torch

from genie.errors import FrameError
from genie.wire.frame import MAX_INLINE_TENSOR_BYTES as MAX_INLINE_TENSOR_BYTES
from genie.wire.spec import DTYPE_NAMES as DTYPE_NAMES  # the codes and tables are the spec's (genie.wire.spec)
from genie.wire.spec import EXT_COMPLEX as EXT_COMPLEX
from genie.wire.spec import EXT_DEVICE as EXT_DEVICE
from genie.wire.spec import EXT_DTYPE as EXT_DTYPE
from genie.wire.spec import EXT_GENERATOR as EXT_GENERATOR
from genie.wire.spec import EXT_INLINE_TENSOR as EXT_INLINE_TENSOR
from genie.wire.spec import EXT_LAYOUT as EXT_LAYOUT
from genie.wire.spec import EXT_MEMORY_FORMAT as EXT_MEMORY_FORMAT
from genie.wire.spec import EXT_TENSOR as EXT_TENSOR
from genie.wire.spec import LAYOUT_NAMES as LAYOUT_NAMES
from genie.wire.spec import MAX_DIMS
from genie.wire.spec import MEMORY_FORMAT_NAMES as MEMORY_FORMAT_NAMES
from genie.wire.spec import RETIRED_CODES as RETIRED_CODES


def _table(names: tuple[str, ...]) -> tuple[list[Any], dict[Any, int]]:
    # getattr on our own constant names, never on received data.
    objs = [getattr(torch, n, None) for n in names]
    return objs, {o: i for i, o in enumerate(objs) if o is not None}


DTYPES, DTYPE_CODES = _table(DTYPE_NAMES)
LAYOUTS, LAYOUT_CODES = _table(LAYOUT_NAMES)
MEMORY_FORMATS, MEMORY_FORMAT_CODES = _table(MEMORY_FORMAT_NAMES)

_COMPLEX = struct.Struct("<dd")


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise FrameError(f"dtype {dtype} cannot cross the wire") from None


def dtype_from_code(code: int) -> torch.dtype:
    if not 0 <= code < len(DTYPES) or DTYPES[code] is None:
        raise FrameError(f"unknown dtype code {code}")
    return DTYPES[code]


def _code_lookup(table: list[Any], data: bytes, what: str) -> Any:
    if len(data) != 1 or data[0] >= len(table) or table[data[0]] is None:
        raise FrameError(f"unknown {what} code {data!r}")
    return table[data[0]]


def inline_tensor(t: torch.Tensor) -> msgpack.ExtType:
    """Encode a small CPU tensor by value."""
    if t.nbytes > MAX_INLINE_TENSOR_BYTES:
        raise FrameError(f"tensor of {t.nbytes} bytes is too large to send inline")
    c = t.detach().contiguous().resolve_conj().resolve_neg()
    raw = c.view(torch.uint8).numpy().tobytes() if c.numel() and c.dim() else _scalar_bytes(c)
    return msgpack.ExtType(EXT_INLINE_TENSOR, msgpack.packb([dtype_code(c.dtype), list(c.shape), raw], use_bin_type=True))


def _scalar_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.reshape(1).view(torch.uint8).numpy().tobytes()


def decode_inline_tensor(data: bytes) -> torch.Tensor:
    try:
        code, shape, raw = msgpack.unpackb(data, raw=False, max_bin_len=MAX_INLINE_TENSOR_BYTES + 64)
    except Exception as exc:
        raise FrameError(f"malformed inline tensor: {exc}") from None
    dtype = dtype_from_code(code)
    if not isinstance(shape, list) or not all(isinstance(s, int) and 0 <= s for s in shape):
        raise FrameError(f"inline tensor has a bad shape {shape!r}")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not isinstance(raw, bytes) or len(raw) != numel * itemsize:
        raise FrameError(f"inline tensor of shape {shape} and dtype {dtype} needs {numel * itemsize} bytes")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()


def encode_common(obj: Any) -> Any:
    """Encode the non-tensor tagged values; returns NotImplemented for anything else."""
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(EXT_DTYPE, bytes([dtype_code(obj)]))
    if isinstance(obj, complex):
        return msgpack.ExtType(EXT_COMPLEX, _COMPLEX.pack(obj.real, obj.imag))
    if isinstance(obj, torch.layout):
        return msgpack.ExtType(EXT_LAYOUT, bytes([LAYOUT_CODES[obj]]))
    if isinstance(obj, torch.memory_format):
        return msgpack.ExtType(EXT_MEMORY_FORMAT, bytes([MEMORY_FORMAT_CODES[obj]]))
    return NotImplemented


def make_ext_hook(
    resolve_tensor: Callable[[Any], Any],
    resolve_device: Callable[[int], Any],
    resolve_generator: Callable[[int], Any],
    tensor_bytes: Callable[[bytes], Any] | None = None,
) -> Callable[[int, bytes], Any]:
    """An ext_hook for :func:`genie.wire.frame.unpack_body`.

    ``resolve_tensor`` gets the decoded msgpack of a tensor descriptor (unchecked: whatever the peer
    sent), ``resolve_device`` and ``resolve_generator`` an integer. ``tensor_bytes``, when given, gets a
    tensor tag's raw payload instead and returns the descriptor or None to fall back to ``resolve_tensor``
    (a cache of descriptor layouts already checked).
    """

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            if tensor_bytes is not None:
                found = tensor_bytes(data)
                if found is not None:
                    return found
            return resolve_tensor(_unpack_small(data))
        if code == EXT_GENERATOR:
            return resolve_generator(_small_int(data))
        if code == EXT_DTYPE:
            return _code_lookup(DTYPES, data, "dtype")
        if code == EXT_DEVICE:
            return resolve_device(_small_int(data))
        if code == EXT_LAYOUT:
            return _code_lookup(LAYOUTS, data, "layout")
        if code == EXT_MEMORY_FORMAT:
            return _code_lookup(MEMORY_FORMATS, data, "memory format")
        if code == EXT_COMPLEX:
            if len(data) != _COMPLEX.size:
                raise FrameError("complex value must be 16 bytes")
            return complex(*_COMPLEX.unpack(data))
        if code == EXT_INLINE_TENSOR:
            return decode_inline_tensor(data)
        if code in RETIRED_CODES:
            raise FrameError(f"value tag {code} (tensor handle) was retired in protocol 2; send tensor "
                             "descriptors (tag 8) instead")
        raise FrameError(f"unknown value tag {code}")

    return ext_hook


#: Bounds on a descriptor's msgpack: MAX_DIMS sizes + MAX_DIMS strides + four scalars fit easily.
_DESC_LIMITS = {"max_array_len": 2 * MAX_DIMS + 8, "max_map_len": 0, "max_str_len": 0, "max_bin_len": 0,
                "max_ext_len": 0}


def _unpack_small(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, **_DESC_LIMITS)
    except Exception as exc:
        raise FrameError(f"malformed tensor descriptor: {exc}") from None


def unpack_descriptor(data: bytes) -> Any:
    """A tensor tag's payload decoded (bounded; FrameError when malformed), not yet checked."""
    return _unpack_small(data)


def _small_int(data: bytes) -> int:
    try:
        value = msgpack.unpackb(data)
    except Exception:
        value = None
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError("device or generator tag must hold an integer")
    return value


def tensor_ext(desc: Sequence[Any]) -> msgpack.ExtType:
    """A tensor tag from ``[storage_id, dtype code, sizes, strides, storage_offset, storage_nbytes]``."""
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb(list(desc)))


def generator_ext(generator_id: int) -> msgpack.ExtType:
    """A generator tag: 0 is the session's default generator of the command's device."""
    return msgpack.ExtType(EXT_GENERATOR, msgpack.packb(generator_id))


def device_ext(index: int) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_DEVICE, msgpack.packb(index))

