"""The frame codec never raises anything but FrameError on arbitrary bytes."""

from __future__ import annotations

from hypothesis import given, settings
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
