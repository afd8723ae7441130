"""The frame codec never raises anything but FrameError on arbitrary bytes."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from genie.errors import FrameError
from genie.server import codec
from genie.wire.frame import HEADER, MAGIC, PROTOCOL_VERSION, decode_header, unpack_body


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=40))
def test_decode_header_raises_only_frame_error(data):
    try:
        decode_header(data)
    except FrameError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_decode_header_bounds_lengths(kind, body_len, payload_len):
    try:
        header = decode_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, body_len, payload_len))
    except FrameError:
        return
    assert header.body_len <= 16 << 20 and header.payload_len <= 8 << 30


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=0, max_size=512))
def test_unpack_body_raises_only_frame_error(data):
    try:
        unpack_body(data)
    except FrameError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=0, max_size=512))
def test_command_decoding_with_tags_raises_only_frame_error(data):
    try:
        codec.decode(b"\xc7" + bytes([len(data) % 256]) + data)  # bias towards ext types
        codec.decode(data)
    except FrameError:
        pass


ints = st.integers(-3, 2**64 - 1) | st.integers(-3, 70)


small = st.integers(0, 6) | st.sampled_from([2**31, 2**62])
plausible = st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.integers(0, 3), st.integers(0, 15), st.lists(small, min_size=n, max_size=n),
    st.lists(st.integers(0, 12), min_size=n, max_size=n), st.integers(0, 40), st.integers(0, 256)).map(list))


@settings(max_examples=600, deadline=None)
@example([1, 0, [2**31, 2**31], [0, 0], 0, 4], None)  # 2**62 elements over one: a legal view, never iterated here
@given(plausible | st.lists(ints | st.lists(ints, max_size=70) | st.text(max_size=3) | st.none(), max_size=7),
       st.integers(0, 256) | st.none())
def test_descriptor_checks_admit_only_tensors_inside_their_storage(fields, actual):
    """Whatever a peer sends, a descriptor either fails parse/check cleanly or builds a tensor inside its storage."""
    from genie.errors import ProtocolError

    try:
        desc = codec.Descriptor.parse(fields)
        known = desc.storage_nbytes if actual is None else actual  # None: the server's size agrees
        desc.check(known if desc.storage_id else None)
    except (FrameError, ProtocolError):
        return
    storage = torch.zeros(desc.storage_nbytes, dtype=torch.uint8).untyped_storage()
    t = desc.over(storage)  # must not raise: every bound was checked
    assert t.dtype == desc.dtype and tuple(t.shape) == desc.sizes
    if t.numel():
        # The element furthest into the storage is inside it, so every element is.
        itemsize = t.element_size()
        last = desc.offset + sum((n - 1) * st for n, st in zip(desc.sizes, desc.strides, strict=True))
        assert (last + 1) * itemsize <= desc.storage_nbytes
        # Writing them all proves it on the real tensor, where that is quick: a stride-0 dimension of
        # 2**31 elements is a legal view of one element that would take hours to write (bounding such
        # iteration is issue 11's pre-flight).
        if t.numel() <= 1 << 16:
            t.zero_()
