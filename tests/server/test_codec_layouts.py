"""The server's cache of checked descriptor layouts: a hit is exactly what the full decode gives.

Pure decoding (genie.server.codec.decode on msgpack bytes a client would send); the bounds checks
against storages run later, per command, and are covered by test_protocol.py and test_hostile.py.
"""

from __future__ import annotations

import msgpack
import pytest

from genie.errors import FrameError
from genie.server import codec
from genie.wire.values import EXT_TENSOR


def _tag(payload: bytes) -> bytes:
    return msgpack.packb([msgpack.ExtType(EXT_TENSOR, payload)])


def _desc(storage_id: int, sizes: list[int], strides: list[int], nbytes: int) -> bytes:
    return _tag(msgpack.packb([storage_id, 0, sizes, strides, 0, nbytes]))


def _same(a: codec.Descriptor, b: codec.Descriptor) -> bool:
    return all(getattr(a, k) == getattr(b, k) for k in codec.Descriptor.__slots__)


@pytest.mark.parametrize("first_id", [5, 200, 70_000, 1 << 40])  # fixint, uint16, uint32, uint64 ids
def test_a_cached_layout_over_a_new_id_equals_the_full_decode(first_id: int) -> None:
    codec._layouts.clear()
    a = codec.decode(_desc(first_id, [3, 4], [4, 1], 48))[0]
    b = codec.decode(_desc(first_id + 1, [3, 4], [4, 1], 48))[0]
    assert len(codec._layouts) == 1
    full = codec.Descriptor.parse([first_id + 1, 0, [3, 4], [4, 1], 0, 48])
    assert _same(b, full) and b.storage_id == first_id + 1 and a.storage_id == first_id
    assert b.span == 48 and b.numel == 12


def test_a_different_layout_is_not_taken_from_the_cache() -> None:
    codec._layouts.clear()
    codec.decode(_desc(1, [3, 4], [4, 1], 48))
    c = codec.decode(_desc(2, [4, 3], [3, 1], 48))[0]
    assert c.sizes == (4, 3) and c.strides == (3, 1) and len(codec._layouts) == 2


def test_malformed_payloads_still_fail_as_frames() -> None:
    codec._layouts.clear()
    codec.decode(_desc(1, [2], [1], 8))
    good_tail = msgpack.packb([1, 0, [2], [1], 0, 8])[2:]
    with pytest.raises(FrameError):  # an id above 2**63-1 with a cached layout behind it
        codec.decode(_tag(b"\x96\xcf" + (1 << 64 - 1).to_bytes(8, "big") + good_tail))
    with pytest.raises(FrameError):  # a negative id
        codec.decode(_tag(b"\x96\xff" + good_tail))
    with pytest.raises(FrameError):  # trailing bytes after a cached layout
        codec.decode(_tag(b"\x96\x07" + good_tail + b"\x00"))
    with pytest.raises(FrameError):  # a negative size: never cached, never accepted
        codec.decode(_desc(3, [-2], [1], 8))


def test_the_cache_is_bounded() -> None:
    codec._layouts.clear()
    for n in range(codec.MAX_LAYOUTS + 10):
        codec.decode(_desc(1, [n], [1], 4 * n))
    assert len(codec._layouts) <= codec.MAX_LAYOUTS
