"""Compression of tensor bytes where the link is slow: the codecs this process has, how a compressed
transfer is described on the wire, and decompression bounded by the size declared before it.

A compressed upload or fetch reply carries a *packing* beside its byte count (docs/protocol.md)::

    [codec, wire_nbytes, shuffle]

``codec`` is ``"zstd"`` (the only one: measured against lz4 on weights, gradients and activations,
lz4 saved under 1% of fp32 bytes where zstd saved 8%, and 16% with the shuffle; docs/network.md),
``wire_nbytes`` the compressed bytes in the payload, ``shuffle`` the element size whose bytes were
grouped by significance before compressing (1: none). Floating-point bytes barely compress as they
lie (the mantissa's low bytes are noise), but their exponent bytes do once they sit together.

The receiving end never decompresses more than the size declared before it (the storage's
``nbytes``, already checked against the session's quotas): the zstd frame must state exactly that
content size, and a frame that says otherwise, does not end where it should or decodes to another
size is refused with :class:`~genie.errors.ProtocolError` before or while decoding, never after
allocating what a lying frame asks for.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import attrs
import numpy as np
import torch

from genie.errors import FrameError, ProtocolError

#: Codecs genie knows, in order of preference.
CODECS = ("zstd",)
#: zstd's level: 1 compressed weights within 1% of level 3 at twice its speed (docs/network.md).
ZSTD_LEVEL = 1
#: Bytes of a tensor compressed first to decide whether the rest is worth it.
SAMPLE_BYTES = 1 << 20
#: A sample that saves less than this share is sent as it is (random integers, already compressed data).
MIN_SAVING = 0.03
#: Element sizes whose bytes may be shuffled.
SHUFFLES = (1, 2, 4, 8)
#: Payloads this large are compressed by several threads (zstd's own workers).
THREADED_BYTES = 8 << 20
#: Longest codec name accepted on the wire.
_MAX_CODEC_NAME = 16


@functools.cache
def available_codecs() -> tuple[str, ...]:
    """The codecs this process can use (``zstd`` needs the ``zstandard`` package)."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return ()
    return ("zstd",)


def missing_hint(codec: str) -> str:
    """What to install for ``codec``."""
    return "pip install zstandard" if codec == "zstd" else f"a genie that knows the {codec!r} codec"


@attrs.frozen
class Packing:
    """How one transfer's bytes were compressed."""

    codec: str
    wire_nbytes: int
    shuffle: int

    def to_wire(self) -> list[Any]:
        """``[codec, wire_nbytes, shuffle]``."""
        return [self.codec, self.wire_nbytes, self.shuffle]


def parse_packing(value: Any, nbytes: int, what: str) -> Packing:
    """A packing from the wire for ``nbytes`` decompressed bytes; FrameError when malformed.

    The codec name is only checked for shape here: a codec this end lacks is a refusal of that
    transfer (:func:`check_codec`), not a broken frame.
    """
    if (type(value) is not list or len(value) != 3 or type(value[0]) is not str
            or not 0 < len(value[0]) <= _MAX_CODEC_NAME or type(value[1]) is not int or type(value[2]) is not int):
        raise FrameError(f"{what}'s packing must be [codec, wire_nbytes, shuffle], got {str(value)[:80]}")
    codec, wire_nbytes, shuffle = value
    if shuffle not in SHUFFLES or nbytes % shuffle:
        raise FrameError(f"{what}'s packing shuffles {shuffle}-byte elements, which do not divide its {nbytes} bytes "
                         f"(allowed: {', '.join(map(str, SHUFFLES))})")
    if not 0 < wire_nbytes <= nbytes:
        raise FrameError(f"{what} sends {wire_nbytes} compressed bytes for {nbytes}; a compressed payload is "
                         "smaller than its data (send it uncompressed otherwise)")
    return Packing(codec, wire_nbytes, shuffle)


def check_codec(codec: str) -> None:
    """ProtocolError unless this process has ``codec``."""
    if codec not in available_codecs():
        raise ProtocolError(f"this end cannot decompress {codec!r} (it has {list(available_codecs()) or 'no codec'}); "
                            f"{missing_hint(codec)}, or send it uncompressed")


def _shuffled(raw: torch.Tensor, shuffle: int) -> torch.Tensor:
    """``raw``'s bytes grouped by their place in each ``shuffle``-byte element (byte 0 of all, byte 1 of all...)."""
    if shuffle == 1:
        return raw
    return raw.view(-1, shuffle).t().contiguous()


def _compressor(nbytes: int) -> Any:
    import zstandard

    threads = min(4, os.cpu_count() or 1) if nbytes >= THREADED_BYTES else 0
    # The checksum (xxHash64, far faster than the link) lets the receiver refuse bytes changed on the way.
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=threads, write_content_size=True, write_checksum=True)


def pack(raw: torch.Tensor, itemsize: int) -> tuple[bytes, Packing] | None:
    """Compress the bytes of ``raw`` (a contiguous CPU uint8 tensor) of ``itemsize``-byte elements with zstd;
    None when this process has no codec or a sample of the bytes saves less than :data:`MIN_SAVING`."""
    if "zstd" not in available_codecs():
        return None
    nbytes = raw.numel()
    shuffle = itemsize if itemsize in SHUFFLES and nbytes % itemsize == 0 else 1
    if nbytes > SAMPLE_BYTES:
        sample = raw[:SAMPLE_BYTES - SAMPLE_BYTES % shuffle]
        if len(_compressor(0).compress(_shuffled(sample, shuffle).numpy())) > sample.numel() * (1 - MIN_SAVING):
            return None
    data = _compressor(nbytes).compress(_shuffled(raw, shuffle).numpy())
    if len(data) > nbytes * (1 - MIN_SAVING):
        return None
    return data, Packing("zstd", len(data), shuffle)


def unpack_into(data: Any, packing: Packing, out: torch.Tensor, what: str) -> None:
    """Decompress ``data`` (a bytes-like of ``packing.wire_nbytes``) into ``out``, a contiguous CPU uint8 tensor
    of exactly the declared size. ProtocolError, with nothing decoded past that size, when the codec is missing,
    the frame states another content size (or none), is corrupt, or has bytes after its end."""
    check_codec(packing.codec)
    import zstandard

    nbytes = out.numel()
    try:
        stated = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        stated = -2
    if stated != nbytes:
        said = "no readable frame header" if stated == -2 else "no content size" if stated == -1 else f"{stated} bytes"
        raise ProtocolError(f"{what}: its zstd frame states {said} but {nbytes} bytes were declared; refused "
                            "without decompressing (a lying size or a decompression bomb)")
    try:
        # The frame's stated size is the declared one, so this allocates at most the declared size; zstd checks
        # that the frame decodes to exactly its stated size, and allow_extra_data=False that nothing follows it.
        plain = zstandard.ZstdDecompressor().decompress(data, max_output_size=nbytes, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: its zstd data is corrupt ({exc}); refused") from None
    if len(plain) != nbytes:
        raise ProtocolError(f"{what}: its zstd data decoded to {len(plain)} bytes, not the {nbytes} declared; refused")
    # numpy reads the immutable bytes without a copy (torch.frombuffer wants a writable buffer).
    flat, dest = np.frombuffer(plain, dtype=np.uint8), out.numpy()
    if packing.shuffle == 1:
        np.copyto(dest, flat)
    else:
        np.copyto(dest.reshape(-1, packing.shuffle), flat.reshape(packing.shuffle, -1).T)
