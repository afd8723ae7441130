"""The pinned staging pool's logic (genie.server.staging.PinnedPool) on CPU: size classes, reuse, the bound,
buffers in flight, release. Plain host memory stands in for page-locked memory (this machine has no CUDA
driver to pin with); the CUDA copies are hardware-only (scripts/gpu-check)."""

from __future__ import annotations

import pytest
import torch

from genie.server.staging import (
    MIN_CLASS,
    CudaStaging,
    PinnedPool,
    plan_chunks,
    size_class,
    staging_for,
    stream_in,
    stream_out,
)


def _host(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_size_classes_are_powers_of_two_from_the_minimum() -> None:
    assert size_class(1) == MIN_CLASS
    assert size_class(MIN_CLASS) == MIN_CLASS
    assert size_class(MIN_CLASS + 1) == 2 * MIN_CLASS
    assert size_class(3 << 20) == 4 << 20
    assert size_class(4 << 20) == 4 << 20


def test_a_returned_buffer_is_reused_for_the_same_class() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    first = pool.take(3 << 20)
    assert first is not None and first.numel() == 4 << 20
    pool.give(first)
    again = pool.take((3 << 20) + 5)  # another size, the same class
    assert again is not None and again.data_ptr() == first.data_ptr()
    assert pool.stats == {"allocated": 1, "reused": 1, "pageable": 0, "released": 0}
    assert pool.bytes == 4 << 20


def test_the_bound_sends_requests_to_the_pageable_path() -> None:
    pool = PinnedPool(8 << 20, max_class=8 << 20, allocate=_host)
    a = pool.take(4 << 20)
    b = pool.take(4 << 20)
    assert a is not None and b is not None
    assert pool.take(1) is None  # 8 MiB in use: nothing more is pinned
    assert pool.take(16 << 20) is None  # over the largest class
    assert pool.stats["pageable"] == 2
    assert pool.bytes == 8 << 20


def test_free_buffers_of_another_class_are_released_to_make_room() -> None:
    pool = PinnedPool(8 << 20, allocate=_host)
    a = pool.take(8 << 20)
    assert a is not None
    pool.give(a)
    small = pool.take(MIN_CLASS)  # the free 8 MiB buffer goes back to the system first
    assert small is not None and small.numel() == MIN_CLASS
    assert pool.stats["released"] == 1
    assert pool.bytes == MIN_CLASS and pool.free_bytes == 0


def test_a_buffer_in_flight_returns_only_once_its_copy_is_done() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    buffer = pool.take(1 << 20)
    assert buffer is not None
    done = [False]
    pool.give(buffer, lambda: done[0])
    assert pool.in_flight == 1
    other = pool.take(1 << 20)  # the copy still reads it: a second buffer
    assert other is not None and other.data_ptr() != buffer.data_ptr()
    done[0] = True
    again = pool.take(1 << 20)
    assert again is not None and again.data_ptr() == buffer.data_ptr()
    assert pool.in_flight == 0


def test_in_flight_buffers_count_against_the_bound() -> None:
    pool = PinnedPool(2 << 20, allocate=_host)
    buffer = pool.take(2 << 20)
    assert buffer is not None
    pool.give(buffer, lambda: False)
    assert pool.take(MIN_CLASS) is None  # not released: a copy may still read it
    pool.clear()
    assert pool.bytes == 2 << 20 and pool.in_flight == 1


def test_staging_is_for_cuda_devices_only() -> None:
    assert staging_for(object(), torch.device("cpu")) is None
    with pytest.raises(ValueError, match="CUDA devices"):
        CudaStaging(torch.device("cpu"))


# -- chunked transfers: the pipeline's planning and ordering, with copies that finish only when waited for --------

def test_chunks_cover_the_transfer_in_order() -> None:
    assert plan_chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert plan_chunks(8, 4) == [(0, 4), (4, 4)]
    assert plan_chunks(0, 4) == []
    with pytest.raises(ValueError, match="at least one byte"):
        plan_chunks(8, 0)


class _Copies:
    """Copies that run when started (the bytes move at once) but report done only once waited for, as a copy
    stream's event does; every step goes into ``log``."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.done: set[int] = set()

    def ready(self, index: int) -> tuple[object, object]:
        def wait() -> None:
            self.log.append(f"wait{index}")
            self.done.add(index)
        return (lambda: index in self.done), wait


CHUNK = 1 << 20


def test_a_download_copies_ahead_while_a_chunk_is_on_the_socket() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    src = torch.arange(5 * CHUNK + 123, dtype=torch.int64).to(torch.uint8)
    copies, sent = _Copies(), list[torch.Tensor]()

    def copy_out(offset: int, buffer: torch.Tensor) -> tuple[object, object]:
        copies.log.append(f"copy{offset // CHUNK}")
        buffer.copy_(src[offset:offset + buffer.numel()])
        return copies.ready(offset // CHUNK)

    def send(chunk: torch.Tensor) -> None:
        copies.log.append(f"send{len(sent)}")
        sent.append(chunk.clone())

    stream_out(pool, src.numel(), copy_out, send, chunk=CHUNK, depth=3)  # type: ignore[arg-type]
    assert torch.equal(torch.cat(sent), src)
    # Three copies start before the first send; each later copy starts once a sent chunk frees its buffer.
    assert copies.log == ["copy0", "copy1", "copy2", "wait0", "send0", "copy3", "wait1", "send1", "copy4",
                          "wait2", "send2", "copy5", "wait3", "send3", "wait4", "send4", "wait5", "send5"]
    assert pool.stats["allocated"] == 3 and pool.bytes == 3 * CHUNK  # three buffers served six chunks
    assert pool.free_bytes == 3 * CHUNK  # all back in the pool


def test_an_upload_copies_each_chunk_while_the_next_is_received() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    src = torch.randint(0, 255, (4 * CHUNK + 7,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copies, received = _Copies(), [0]

    def receive(buffer: torch.Tensor) -> None:
        copies.log.append(f"recv{received[0] // CHUNK}")
        buffer.copy_(src[received[0]:received[0] + buffer.numel()])
        received[0] += buffer.numel()

    def copy_in(offset: int, buffer: torch.Tensor) -> tuple[object, object]:
        copies.log.append(f"copy{offset // CHUNK}")
        dst[offset:offset + buffer.numel()].copy_(buffer)
        return copies.ready(offset // CHUNK)

    stream_in(pool, src.numel(), receive, copy_in, chunk=CHUNK, depth=2)  # type: ignore[arg-type]
    assert torch.equal(dst, src)
    # Chunk k's copy is started before chunk k+1 is received; a buffer is waited for only when both are in flight.
    assert copies.log == ["recv0", "copy0", "recv1", "copy1", "wait0", "recv2", "copy2", "wait1", "recv3", "copy3",
                          "wait2", "recv4", "copy4"]
    assert pool.stats["allocated"] == 2
    assert pool.in_flight == 2  # the last two copies were not waited for: back to the pool once done
    copies.done.update({3, 4})
    assert pool.take(CHUNK) is not None and pool.in_flight == 0


def test_a_chunked_transfer_stays_within_the_pools_bound() -> None:
    pool = PinnedPool(2 * CHUNK, allocate=_host)  # room for two chunk buffers, not the three asked for
    src = torch.randint(0, 255, (5 * CHUNK,), dtype=torch.uint8)
    copies, sent = _Copies(), list[torch.Tensor]()

    def copy_out(offset: int, buffer: torch.Tensor) -> tuple[object, object]:
        buffer.copy_(src[offset:offset + buffer.numel()])
        return copies.ready(offset // CHUNK)

    stream_out(pool, src.numel(), copy_out, lambda c: sent.append(c.clone()), chunk=CHUNK, depth=3)  # type: ignore[arg-type]
    assert torch.equal(torch.cat(sent), src)
    assert pool.stats["allocated"] == 2 and pool.bytes == 2 * CHUNK  # the third waited for a sent chunk's buffer
    tiny = PinnedPool(CHUNK // 2, allocate=_host)  # not even one chunk: pageable memory, counted, still exact
    sent.clear()
    stream_out(tiny, src.numel(), copy_out, lambda c: sent.append(c.clone()), chunk=CHUNK, depth=3)  # type: ignore[arg-type]
    assert torch.equal(torch.cat(sent), src) and tiny.bytes == 0 and tiny.stats["pageable"] >= 5


def test_a_failed_send_gives_every_chunk_buffer_back() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    copies = _Copies()

    def copy_out(offset: int, buffer: torch.Tensor) -> tuple[object, object]:
        return copies.ready(offset // CHUNK)

    def send(chunk: torch.Tensor) -> None:
        raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError):
        stream_out(pool, 4 * CHUNK, copy_out, send, chunk=CHUNK, depth=3)  # type: ignore[arg-type]
    # The one being sent is back; the two copies still in flight come back once done.
    assert pool.free_bytes == CHUNK and pool.in_flight == 2
    copies.done.update({1, 2})
    pool.clear()
    assert pool.bytes == 0


def test_a_failed_receive_gives_every_chunk_buffer_back() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    copies, calls = _Copies(), [0]

    def receive(buffer: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError):
        stream_in(pool, 4 * CHUNK, receive, lambda offset, b: copies.ready(offset // CHUNK),  # type: ignore[arg-type,return-value]
                  chunk=CHUNK, depth=3)
    assert pool.free_bytes == CHUNK and pool.in_flight == 2  # the failed one now, the two copying once done


def test_chunked_replies_are_never_ones_a_resume_would_keep() -> None:
    from genie.server.resume import MAX_RECORDED_BYTES
    from genie.server.staging import CHUNK_BYTES, CHUNKED_FROM

    assert CHUNKED_FROM >= MAX_RECORDED_BYTES and CHUNK_BYTES <= CHUNKED_FROM


def _tcp_pair() -> tuple[object, object]:
    import socket

    from genie.transport.stream import TcpChannel

    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        client = socket.create_connection(listener.getsockname()[:2], timeout=5)
        server, _ = listener.accept()
    return TcpChannel(server, "client"), TcpChannel(client, "server")


def test_a_reply_in_parts_arrives_as_one_frame_and_leaves_no_resume_record() -> None:
    """Executor.reply_in_parts (a chunked download's reply) over a real loopback TCP connection, through the
    ResumeLink a resumable session sends with: one REPLY frame whose payload is the parts in order."""
    from genie.errors import ProtocolError
    from genie.server.executor import Executor
    from genie.server.resume import ResumeLink
    from genie.server.store import StorageStore
    from genie.wire.buffers import tensor_bytes
    from genie.wire.frame import MsgKind, recv_frame, recv_payload, unpack_body

    server, client = _tcp_pair()
    try:
        link = ResumeLink(server)  # type: ignore[arg-type]
        link.record = (1, b"an older reply")
        ex = Executor(link, StorageStore(), [torch.device("cpu")])  # type: ignore[arg-type]
        data = torch.randint(0, 255, (3 * CHUNK + 5,), dtype=torch.uint8)

        def write(part: object) -> None:
            for offset in range(0, data.numel(), CHUNK):
                part(tensor_bytes(data[offset:offset + CHUNK]))  # type: ignore[operator]

        ex.reply_in_parts(7, ["described"], data.numel(), write)
        kind, body, payload_len = recv_frame(client, memoryview(bytearray(16)))  # type: ignore[arg-type]
        assert kind == MsgKind.REPLY and payload_len == data.numel()
        assert unpack_body(body)[:3] == [7, None, ["described"]]
        got = torch.empty_like(data)
        recv_payload(client, payload_len, [tensor_bytes(got)])  # type: ignore[arg-type]
        assert torch.equal(got, data)
        assert link.record is None  # a resume would not send a part of it again
        with pytest.raises(ProtocolError, match="sent 5 of the 6 payload bytes"):
            ex.reply_in_parts(8, None, 6, lambda part: part(memoryview(b"12345")))
    finally:
        server.close()  # type: ignore[attr-defined]
        client.close()  # type: ignore[attr-defined]
