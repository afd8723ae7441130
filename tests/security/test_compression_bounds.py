"""Compressed uploads are decompressed only within the size declared before them (docs/SECURITY.md, "Compressed
uploads"): a decompression bomb, a lying size, a corrupt frame or a codec the node lacks is refused for that
storage with a clear deferred error, and the session goes on."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zstandard

from genie.wire.frame import MsgKind, pack_body, send_frame
from tests.raw_client import RawClient, desc, fetch, sync


def packed_upload(c: RawClient, storage_id: int, nbytes: int, data: bytes, codec: str = "zstd",
                  shuffle: int = 1) -> dict[str, Any] | None:
    """Send one compressed upload of ``nbytes`` declared bytes as ``data``, then a SYNC; the one deferred error
    (or None)."""
    upload = [storage_id, 0, nbytes, None, None, [codec, len(data), shuffle]]
    send_frame(c.channel, MsgKind.BATCH, pack_body({"uploads": [upload], "cmds": [sync(c.next_req())]}),
               [memoryview(data)])
    reply = c.reply()
    assert reply.error is None and len(reply.deferred) <= 1, reply
    return reply.deferred[0] if reply.deferred else None


def zeros_frame(nbytes: int, *, content_size: bool = True) -> bytes:
    """A zstd frame of ``nbytes`` zeros, made in 1 MiB pieces (a bomb need not exist whole on the sender)."""
    out = zstandard.ZstdCompressor(level=1, write_content_size=content_size).compressobj(size=nbytes if
                                                                                         content_size else -1)
    piece, parts, left = bytes(1 << 20), [], nbytes
    while left:
        parts.append(out.compress(piece[:min(left, len(piece))]))
        left -= min(left, len(piece))
    parts.append(out.flush())
    return b"".join(parts)


@pytest.fixture
def session(dp_server) -> Any:
    server = dp_server(max_session_bytes=64 << 20)
    with RawClient(server.port) as c:
        welcome = c.handshake()
        assert "zstd" in welcome["codecs"], welcome
        yield c


def still_serves(c: RawClient, storage_id: int = 50) -> None:
    t = torch.arange(1 << 16, dtype=torch.float32)
    data = zstandard.ZstdCompressor().compress(t.numpy().tobytes())
    assert packed_upload(c, storage_id, t.nbytes, data) is None
    assert torch.equal(c.fetch(storage_id, t), t)


def test_a_bomb_that_states_more_than_its_declared_size_is_refused_before_decompressing(session) -> None:
    bomb = zeros_frame(1 << 30)  # 1 GiB of zeros in about 32 KB
    err = packed_upload(session, 1, 1 << 16, bomb)
    assert err is not None and err["storages"] == [1] and "states 1073741824 bytes but 65536 bytes were declared" in err["message"], err
    assert "refused without decompressing" in err["message"]
    still_serves(session)


def test_a_declared_size_beyond_the_quota_is_refused_before_decompressing(session) -> None:
    err = packed_upload(session, 2, 256 << 20, zeros_frame(256 << 20))
    assert err is not None and err["kind"] == "quota" and "max_session_bytes" in err["message"], err
    still_serves(session)


@pytest.mark.parametrize("case", ["no content size", "corrupt", "trailing bytes", "decodes short"])
def test_a_frame_that_lies_or_is_corrupt_is_refused_and_the_session_goes_on(session, case: str) -> None:
    good = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(range(256)) * 1024)
    nbytes = 256 * 1024
    if case == "no content size":
        data = zeros_frame(nbytes, content_size=False)
        expect = "states no content size"
    elif case == "corrupt":
        data = good[:20] + bytes(b ^ 0xFF for b in good[20:40]) + good[40:]
        expect = "corrupt"
    elif case == "trailing bytes":
        data = good + b"\0" * 16
        expect = "corrupt"
    else:  # a frame that states the declared size but ends early
        data = good[:-8]
        expect = "corrupt"
    err = packed_upload(session, 3, nbytes, data)
    assert err is not None and err["storages"] == [3] and expect in err["message"], err
    assert err["kind"] == "protocol", err
    # The storage holds nothing: reading it names the refusal.
    r = session.request([fetch(session.next_req(), desc(3, torch.empty(nbytes, dtype=torch.uint8)))])
    assert r.error is not None and "holds nothing" in r.error["message"] and expect in r.error["message"], r.error
    still_serves(session)


def test_a_codec_the_node_lacks_is_refused_for_that_upload(session) -> None:
    err = packed_upload(session, 4, 1024, b"\0" * 100, codec="lz4")
    assert err is not None and "cannot decompress 'lz4'" in err["message"] and "send it uncompressed" in err["message"]
    still_serves(session)


def test_a_packing_that_breaks_the_wire_rules_closes_only_that_session(dp_server) -> None:
    server = dp_server()
    with RawClient(server.port) as c:
        c.handshake()
        upload = [5, 0, 1024, None, None, ["zstd", 2048, 1]]  # more compressed bytes than it decompresses to
        send_frame(c.channel, MsgKind.BATCH, pack_body({"uploads": [upload], "cmds": []}), [memoryview(bytes(2048))])
        kind, body, _ = c.recv()
        assert kind == MsgKind.ERROR and "a compressed payload is smaller than its data" in body["reason"], body
    with RawClient(server.port) as other:
        other.handshake()
        assert other.sync().error is None
