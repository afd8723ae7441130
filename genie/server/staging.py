"""Page-locked staging for a CUDA server's transfers: uploads land in pinned memory and reach the GPU by
asynchronous copies on a copy stream; downloads leave from pinned memory.

Without it, an upload to a CUDA device is received into pageable memory and copied with a blocking
``tensor.to(device)`` (the driver bounces every byte through its own pinned buffer), and a download
is a blocking copy back into pageable memory: the H200 run of 2026-11-26 measured uploads plus
downloads at 0.37x raw TCP.

- :class:`PinnedPool` holds page-locked host buffers by size class (powers of two from
  :data:`MIN_CLASS`), bounded by :data:`MAX_PINNED_BYTES` in all (in use, in flight and free). A
  request it cannot serve within the bound gets None, and the caller takes the pageable path, which
  is counted (``pageable``): nothing fails for want of pinned memory. A buffer whose copy is still in
  flight comes back to the pool only once its readiness check (the copy's CUDA event) says done.
- :class:`CudaStaging` is one session's use of it on one device: :meth:`~CudaStaging.receive_buffer`
  hands out the buffer a socket receive lands in, :meth:`~CudaStaging.upload` makes the device
  storage (allocated on the copy stream, so the caching allocator never gives it memory the compute
  stream may still use), copies into it without blocking and makes the compute stream wait for that
  copy only where later work needs it (an event: work already queued keeps running, overlapped);
  :meth:`~CudaStaging.download` copies a device tensor into a pinned buffer after the compute stream's
  pending work and waits for that copy alone.

- Transfers over :data:`CHUNKED_FROM` go in :data:`CHUNK_BYTES` chunks through at most
  :data:`CHUNK_DEPTH` pinned buffers (:func:`stream_out`, :func:`stream_in`; the CUDA side in
  :meth:`~CudaStaging.download_stream` and :meth:`~CudaStaging.upload_stream`): a download's
  device-to-host copies of the next chunks run while one is on the socket, and its reply goes out in
  parts (``Executor.reply_in_parts``); an upload's host-to-device copy of a chunk runs while the next is
  received, into the existing storage in place or new device memory. Before, a transfer over
  :data:`MAX_CLASS` took the pageable path whole, and a download copied the whole tensor to host
  before sending its first byte.

The pool's logic and the chunk pipeline's planning and ordering are tested on CPU (tests/server/test_staging.py, with plain host memory standing in
for page-locked memory); the CUDA part is hardware-only and runs under ``scripts/gpu-check``
(tests/device/test_transfers.py against ``genie serve --devices cuda:0``).
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("genie.server.staging")

#: Smallest size class (smaller transfers are not worth a pinned buffer: the pageable copy is cheap).
MIN_CLASS = 1 << 16
#: Page-locked bytes one session worker keeps at most (in use, in flight and free together).
MAX_PINNED_BYTES = 512 << 20
#: Largest single buffer (a bigger transfer goes in chunks, see CHUNKED_FROM).
MAX_CLASS = 256 << 20
#: A transfer to or from a CUDA device larger than this goes through pinned staging in chunks, its copies
#: overlapping the socket (and a download's reply is then sent in parts: larger than genie.server.resume's
#: MAX_RECORDED_BYTES, so it is never one a resume would send again).
CHUNKED_FROM = 64 << 20
#: Bytes of one chunk (a size class of its own: every chunk buffer is reused by the next chunk).
CHUNK_BYTES = 16 << 20
#: Chunk buffers one transfer holds at most: the one on the socket and the copies in flight.
CHUNK_DEPTH = 3

#: A copy started on a chunk: (whether it is done, wait until it is).
Ready = tuple[Callable[[], bool], Callable[[], None]]


def size_class(nbytes: int) -> int:
    """The buffer size serving ``nbytes``: the next power of two, at least :data:`MIN_CLASS`."""
    return max(MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Page-locked host buffers by size class, bounded; reused once their copies are done."""

    def __init__(self, max_bytes: int = MAX_PINNED_BYTES, *, max_class: int = MAX_CLASS,
                 allocate: Callable[[int], torch.Tensor] = _pinned) -> None:
        self.max_bytes = max_bytes
        self.max_class = max_class
        self._allocate = allocate
        self._free: dict[int, list[torch.Tensor]] = {}
        self._in_flight: list[tuple[torch.Tensor, Callable[[], bool]]] = []
        #: page-locked bytes held: in use, in flight and free
        self.bytes = 0
        #: books: buffers allocated, reused, requests sent to the pageable path, buffers released
        self.stats = {"allocated": 0, "reused": 0, "pageable": 0, "released": 0}

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A pinned uint8 buffer of at least ``nbytes`` (a reused one where a free one fits), or None when the
        request is too large or the bound is reached: the caller then uses pageable memory."""
        size = size_class(nbytes)
        if size > self.max_class:
            self.stats["pageable"] += 1
            return None
        self._reclaim()
        stack = self._free.get(size)
        if stack:
            self.stats["reused"] += 1
            return stack.pop()
        if self.bytes + size > self.max_bytes:
            self._release_free(self.bytes + size - self.max_bytes)
            if self.bytes + size > self.max_bytes:
                self.stats["pageable"] += 1
                return None
        buffer = self._allocate(size)
        self.bytes += size
        self.stats["allocated"] += 1
        return buffer

    def give(self, buffer: torch.Tensor, ready: Callable[[], bool] | None = None) -> None:
        """Return ``buffer``; ``ready`` says when the copy still reading or writing it is done (None: now)."""
        if ready is not None and not ready():
            self._in_flight.append((buffer, ready))
            return
        self._free.setdefault(buffer.numel(), []).append(buffer)

    @property
    def free_bytes(self) -> int:
        return sum(size * len(stack) for size, stack in self._free.items())

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _reclaim(self) -> None:
        if not self._in_flight:
            return
        still = []
        for buffer, ready in self._in_flight:
            if ready():
                self._free.setdefault(buffer.numel(), []).append(buffer)
            else:
                still.append((buffer, ready))
        self._in_flight = still

    def _release_free(self, need: int) -> None:
        """Give free buffers back to the system, largest first, until ``need`` bytes went (or none is left)."""
        for size in sorted(self._free, reverse=True):
            stack = self._free[size]
            while stack and need > 0:
                stack.pop()
                self.bytes -= size
                need -= size
                self.stats["released"] += 1
            if not stack:
                del self._free[size]
            if need <= 0:
                return

    def clear(self) -> None:
        """Release every free buffer (those in flight stay until their copies end)."""
        self._reclaim()
        self._release_free(self.bytes)


def plan_chunks(nbytes: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` of each chunk of an ``nbytes`` transfer, in order; the last may be shorter."""
    if chunk <= 0:
        raise ValueError(f"a chunk must hold at least one byte, not {chunk}")
    return [(offset, min(chunk, nbytes - offset)) for offset in range(0, nbytes, chunk)]


class _ChunkBuffers:
    """The chunk buffers of one transfer: from the pool (pinned), at most ``depth`` held at once.

    When the pool has nothing for a chunk (its bound is reached) the oldest chunk is retired first
    (``retire``: its copy waited for, its buffer given back) and the pool asked again; with no chunk
    left to retire, that chunk uses pageable memory (the pool counts it as ``pageable``).
    """

    def __init__(self, pool: PinnedPool, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a chunked transfer needs at least one buffer, not {depth}")
        self.pool = pool
        self.depth = depth
        #: (buffer, its length in this chunk, pinned, the copy's readiness), oldest first
        self.held: collections.deque[tuple[torch.Tensor, int, bool, Ready]] = collections.deque()

    def take(self, nbytes: int, retire: Callable[[], None]) -> tuple[torch.Tensor, bool]:
        while len(self.held) >= self.depth:
            retire()
        while True:
            buffer = self.pool.take(nbytes)
            if buffer is not None:
                return buffer, True
            if not self.held:
                return torch.empty(nbytes, dtype=torch.uint8), False
            retire()

    def give_back(self, buffer: torch.Tensor, pinned: bool, ready: Callable[[], bool] | None = None) -> None:
        if pinned:
            self.pool.give(buffer, ready)

    def abandon(self) -> None:
        """After a failure: every held buffer back to the pool once its copy is done (not waited for)."""
        while self.held:
            buffer, _, pinned, (done, _) = self.held.popleft()
            self.give_back(buffer, pinned, done)


def stream_out(pool: PinnedPool, nbytes: int, copy_out: Callable[[int, torch.Tensor], Ready],
               send: Callable[[torch.Tensor], None], *, chunk: int = CHUNK_BYTES, depth: int = CHUNK_DEPTH) -> None:
    """A download in chunks: ``copy_out(offset, buffer)`` starts the copy of the source's bytes at ``offset``
    into ``buffer`` (the chunk's length) and returns its readiness; ``send(buffer)`` sends a chunk whose copy
    is done. Up to ``depth`` copies are started ahead, so the copy of chunk k+1 (and k+2) runs while chunk k
    is on the socket; each buffer serves a later chunk once sent."""
    buffers = _ChunkBuffers(pool, depth)

    def retire() -> None:
        buffer, length, pinned, (_, wait) = buffers.held.popleft()
        try:
            wait()
            send(buffer[:length])
        finally:
            buffers.give_back(buffer, pinned)  # sent (or failed): the socket no longer reads it

    try:
        for offset, length in plan_chunks(nbytes, chunk):
            buffer, pinned = buffers.take(min(chunk, nbytes), retire)  # one size class: every buffer is reused
            buffers.held.append((buffer, length, pinned, copy_out(offset, buffer[:length])))
        while buffers.held:
            retire()
    finally:
        buffers.abandon()


def stream_in(pool: PinnedPool, nbytes: int, receive: Callable[[torch.Tensor], None],
              copy_in: Callable[[int, torch.Tensor], Ready], *, chunk: int = CHUNK_BYTES,
              depth: int = CHUNK_DEPTH) -> None:
    """An upload in chunks: ``receive(buffer)`` fills a chunk from the socket, ``copy_in(offset, buffer)`` starts
    its copy to the destination's bytes at ``offset`` and returns its readiness. The copy of chunk k runs while
    chunk k+1 is received; a buffer serves a later chunk once its copy is done (waited for only when all
    ``depth`` buffers are in flight or the pool's bound is reached). Buffers still in flight at the end go back
    to the pool with their readiness checks: this returns without waiting for the last copies (whoever uses
    the destination orders itself after them)."""
    buffers = _ChunkBuffers(pool, depth)

    def retire() -> None:
        buffer, _, pinned, (done, wait) = buffers.held.popleft()
        try:
            wait()
        finally:
            buffers.give_back(buffer, pinned, done)

    try:
        for offset, length in plan_chunks(nbytes, chunk):
            buffer, pinned = buffers.take(min(chunk, nbytes), retire)
            view = buffer[:length]
            try:
                receive(view)
            except BaseException:
                buffers.give_back(buffer, pinned)  # no copy reads it yet
                raise
            buffers.held.append((buffer, length, pinned, copy_in(offset, view)))
    finally:
        buffers.abandon()


class CudaStaging:
    """One session's pinned staging and copy stream on one CUDA device (hardware-only)."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"pinned staging serves CUDA devices, not {device}")
        self.device = device
        self.pool = pool if pool is not None else PinnedPool()
        self.copy_stream = torch.cuda.Stream(device)
        #: pinned buffer address -> whether the copy reading it is done (uploads in flight)
        self._copies: dict[int, Callable[[], bool]] = {}

    def receive_buffer(self, nbytes: int) -> torch.Tensor:
        """The host memory an upload of ``nbytes`` is received into: pinned where the pool can, else pageable."""
        buffer = self.pool.take(nbytes) if nbytes >= MIN_CLASS else None
        if buffer is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        view = buffer[:nbytes]
        # Back to the pool when the receive's tensor is dropped, whichever path used it (an upload into an
        # existing storage copies and drops it too), once the copy reading it is done.
        weakref.finalize(view, self._returned, buffer)
        return view

    def _returned(self, buffer: torch.Tensor) -> None:
        self.pool.give(buffer, self._copies.pop(buffer.data_ptr(), None))

    def upload(self, raw: torch.Tensor) -> torch.Tensor:
        """A device uint8 tensor holding ``raw``'s bytes (from :meth:`receive_buffer`: non-blocking when pinned)."""
        base = raw._base if raw._base is not None else raw
        pinned = base.is_pinned()
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            out = torch.empty(raw.numel(), dtype=torch.uint8, device=self.device)
            out.copy_(raw, non_blocking=pinned)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        compute.wait_event(done)  # later work on the compute stream sees the bytes; earlier work runs on
        out.record_stream(compute)  # freed from the compute stream's point of view, not the copy stream's
        if pinned:
            self._copies[base.data_ptr()] = done.query  # the buffer returns once this copy has read it
        return out

    def download(self, src: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """``src``'s bytes in host memory (pinned where the pool can) and the function that hands the buffer
        back once it has been sent."""
        dense = src.contiguous()
        buffer = self.pool.take(dense.nbytes) if dense.nbytes >= MIN_CLASS else None
        if buffer is None:
            return dense.cpu(), lambda: None
        host = buffer[:dense.nbytes].view(dense.dtype).view(dense.shape)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the work that wrote src
        with torch.cuda.stream(self.copy_stream):
            host.copy_(dense, non_blocking=True)
            dense.record_stream(self.copy_stream)
        self.copy_stream.synchronize()  # this copy alone; compute queued meanwhile keeps running
        return host, lambda: self.pool.give(buffer)


    def _event(self) -> Ready:
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done.query, done.synchronize

    def download_stream(self, src: torch.Tensor, send: Callable[[torch.Tensor], None]) -> None:
        """Send a large device tensor's bytes (contiguous: ``src.contiguous()``'s) in chunks through pinned buffers
        (:func:`stream_out`): the device-to-host copy of the next chunks runs on the copy stream while ``send``
        sends one. Hardware-only."""
        dense = src.contiguous()
        flat = dense.reshape(-1).view(torch.uint8)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the work that wrote src
        dense.record_stream(self.copy_stream)

        def copy_out(offset: int, buffer: torch.Tensor) -> Ready:
            with torch.cuda.stream(self.copy_stream):
                buffer.copy_(flat[offset:offset + buffer.numel()], non_blocking=True)
                return self._event()

        stream_out(self.pool, dense.nbytes, copy_out, send)

    def upload_stream(self, nbytes: int, receive: Callable[[torch.Tensor], None],
                      into: torch.Tensor | None = None) -> torch.Tensor:
        """Receive a large upload in chunks through pinned buffers (:func:`stream_in`), each chunk's host-to-device
        copy running on the copy stream while the next is received; returns the device uint8 tensor holding the
        bytes: ``into`` (a device uint8 tensor over an existing storage, written in place) or a new one
        (allocated on the copy stream, as :meth:`upload` allocates). The compute stream waits for the last copy
        before its later work; nothing waits here. Hardware-only."""
        compute = torch.cuda.current_stream(self.device)
        if into is None:
            with torch.cuda.stream(self.copy_stream):
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            out = into
            self.copy_stream.wait_stream(compute)  # work queued before may still read the storage's old bytes
        last: list[torch.cuda.Event] = []

        def copy_in(offset: int, buffer: torch.Tensor) -> Ready:
            with torch.cuda.stream(self.copy_stream):
                out[offset:offset + buffer.numel()].copy_(buffer, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            last[:] = [done]
            return done.query, done.synchronize

        stream_in(self.pool, nbytes, receive, copy_in)
        if last:
            compute.wait_event(last[0])  # later work on the compute stream sees every chunk
        if into is None:
            out.record_stream(compute)  # freed from the compute stream's point of view
        return out


def staging_for(holder: Any, device: torch.device) -> CudaStaging | None:
    """``holder``'s CudaStaging for ``device`` (made on first use, one pool per holder), or None off CUDA."""
    if device.type != "cuda":
        return None
    per_device: dict[Any, CudaStaging] | None = getattr(holder, "_genie_cuda_staging", None)
    if per_device is None:
        per_device = {}
        holder._genie_cuda_staging = per_device
    staging = per_device.get(device)
    if staging is None:
        pool = next(iter(per_device.values())).pool if per_device else PinnedPool()
        staging = per_device[device] = CudaStaging(device, pool)
    return staging
