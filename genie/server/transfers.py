"""A session's bulk transfers: uploads (sent or named by content key), fetches, and their buffers.

The executor calls in here for a BATCH's ``uploads`` and ``cached`` lists and for the
``CMD_FETCH`` and ``CMD_HAVE`` commands; everything about moving tensor bytes lives here.

- **Uploads** are received straight into the memory that becomes the storage. That memory
  comes from the session's :class:`StagingPool` when a storage of the same size was freed
  before (pages already faulted in: a 64 MiB receive into fresh pages takes 16,385 page faults,
  more time than the copy), else it is new and prefaulted in one system call.
- **The weight cache** (:mod:`genie.server.content`): ``CMD_HAVE`` looks content keys up (within
  the session's :class:`~genie.server.content.HaveBudget`) and reserves the hits for the next
  batch, whose ``cached`` entries then become storages copied from the cache; an upload that
  names a key lands in a memfd that is sealed, once its writable mapping is gone, and offered
  to the cache.
- **Fetches** send a storage's bytes from its own memory (a contiguous CPU tensor) or from a
  contiguous CPU copy.
- **Compression** (:mod:`genie.wire.compress`): an upload may arrive compressed (its entry's
  packing); it is received whole, then decompressed into the storage's memory, never past the
  byte count it declared, which was checked against the quotas (and an existing storage's size)
  before anything was decompressed. A batch whose ``reply_codec`` names a codec gets its fetch
  reply compressed with it, when the bytes compress.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from genie.errors import FrameError, ProtocolError, QuotaExceededError, RemoteExecutionError
from genie.server import codec
from genie.server.codec import MAX_NBYTES, Descriptor, DeviceRef, check_id, is_int
from genie.server.content import REFUSALS, ContentCache, HaveBudget, Receiver
from genie.server.records import error as _error
from genie.server.records import kind_of as _kind_of
from genie.server.records import message as _message
from genie.server.staging import CHUNKED_FROM, CudaStaging, staging_for
from genie.server.store import StorageError
from genie.wire import compress
from genie.wire.buffers import populated_ahead, prefault, tensor_bytes
from genie.wire.content import KEY_BYTES, MAX_HAVE_ENTRIES, NONCE_BYTES
from genie.wire.frame import FrameHeader, discard_payload, recv_payload
from genie.wire.spec import BATCH_CACHED, BATCH_UPLOADS

if TYPE_CHECKING:
    from genie.server.executor import Executor

log = logging.getLogger("genie.server.transfers")

#: Freed CPU storages at least this large are kept for reuse by later uploads of the same size.
POOL_MIN_BYTES = 1 << 20
#: Bytes a session's staging pool keeps at most (its freed storages waiting for reuse).
POOL_MAX_BYTES = 512 << 20
#: Python references to a storage StorageStore.free hands to StagingPool.give when nothing else holds it.
_PY_REFS = 3
#: Most content keys one CMD_HAVE may ask about.
MAX_HAVE_KEYS = MAX_HAVE_ENTRIES


class StagingPool:
    """Freed CPU storages of one session, by size, reused as the memory of later uploads (bounded).

    A reused storage held this session's own bytes, and an upload overwrites every byte, so
    nothing crosses sessions. Only storages nobody else references are taken: torch's use count
    of 1 (no tensor, view or cache entry points at them) and no other Python reference than the
    freeing store's (``_PY_REFS``: its local, this call's argument, ``getrefcount``'s own).
    """

    def __init__(self, max_bytes: int = POOL_MAX_BYTES, min_bytes: int = POOL_MIN_BYTES) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._by_size: dict[int, list[torch.UntypedStorage]] = {}
        #: data pointers of memory never to reuse (mappings of the weight cache's files)
        self.skip: set[int] = set()
        self.bytes = 0
        self.reused = 0

    def give(self, storage: torch.UntypedStorage) -> None:
        """Offer a storage the session just freed."""
        nbytes = storage.nbytes()
        if self.skip and storage.data_ptr() in self.skip:
            self.skip.discard(storage.data_ptr())
            return
        if (nbytes < self.min_bytes or storage.device.type != "cpu" or self.bytes + nbytes > self.max_bytes
                or torch._C._storage_Use_Count(storage._cdata) != 1 or sys.getrefcount(storage) > _PY_REFS):
            return
        self._by_size.setdefault(nbytes, []).append(storage)
        self.bytes += nbytes

    def take(self, nbytes: int, *, populate: bool = True) -> torch.Tensor:
        """A CPU uint8 tensor of ``nbytes`` to receive into: a pooled storage's, else new (and prefaulted, unless
        ``populate`` is False: a receive populates it as it goes, genie.wire.buffers.populated_ahead)."""
        stack = self._by_size.get(nbytes)
        if stack:
            storage = stack.pop()
            if not stack:
                del self._by_size[nbytes]
            self.bytes -= nbytes
            self.reused += 1
            log.debug("upload of %d bytes received into a reused storage", nbytes)
            return torch.empty(0, dtype=torch.uint8).set_(storage)
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if populate:
            prefault(raw)
        return raw

    def clear(self) -> None:
        """Release every pooled storage."""
        self._by_size.clear()
        self.bytes = 0


class SessionTransfers:
    """One session's transfer state: its staging pool, the node's cache, this session's nonce and reservations."""

    def __init__(self, cache: ContentCache | None = None) -> None:
        self.pool = StagingPool()
        self.cache = cache
        self.nonce = os.urandom(NONCE_BYTES)
        #: HAVE entries this session may still have looked up
        self.have_budget = HaveBudget()
        #: hits of the last CMD_HAVE, (key, nbytes) -> a private mapping of the bytes, for the next batch's ``cached``
        self.reserved: dict[tuple[bytes, int], torch.Tensor] = {}
        #: the codec the current batch's fetch reply may be compressed with (its ``reply_codec``), taken by fetch()
        self.reply_codec: str | None = None

    def mapped(self, storage: torch.UntypedStorage, device: torch.device | None = None) -> torch.Tensor:
        """A uint8 tensor over a cache mapping; the pool never reuses such memory (a write to it copies pages).

        ``device``: where it goes; only a CPU storage keeps the mapping (elsewhere it is copied).
        """
        if device is None or device.type == "cpu":
            self.pool.skip.add(storage.data_ptr())
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def offer(self) -> dict[str, Any]:
        """The WELCOME's ``cache`` entry: ``{"enabled": False}`` when the node keeps no cache."""
        return {"enabled": False} if self.cache is None else self.cache.offer(self.nonce)


#: An upload as parsed: storage id, device, byte count, content key, possession secret (both None: not keyed),
#: packing (None: sent as it is).
Upload = tuple[int, torch.device, int, bytes | None, bytes | None, compress.Packing | None]


def _receive_buffer(transfers: SessionTransfers, device: torch.device, nbytes: int) -> torch.Tensor:
    """Where an upload's bytes are received: pinned staging for a CUDA device, else the session's pool."""
    staging = staging_for(transfers, device)
    return staging.receive_buffer(nbytes) if staging is not None else transfers.pool.take(nbytes, populate=False)


def _parse_upload(ex: Executor, up: Any, cached: bool) -> Upload:
    if not isinstance(up, list) or len(up) not in ((4,) if cached else (3, 4, 5, 6)):
        shape = "[storage_id, device, nbytes, key]" if cached else \
            "[storage_id, device, nbytes(, key, possession(, packing))]"
        raise FrameError(f"an {'cached ' if cached else ''}upload must be {shape}, got {codec.preview(up)}")
    storage_id = check_id(up[0], "upload storage id")
    index = up[1].index if isinstance(up[1], DeviceRef) else up[1]
    if not is_int(index) or not 0 <= index < len(ex.devices):
        raise FrameError(f"upload {storage_id} names device {index!r}; this node has {len(ex.devices)}")
    nbytes = up[2]
    if not is_int(nbytes) or not 0 <= nbytes <= MAX_NBYTES:
        raise FrameError(f"upload {storage_id} has a bad byte count {codec.preview(nbytes)}")
    if storage_id == 0:
        raise FrameError("an upload cannot target storage 0 (the empty storage)")
    key = up[3] if len(up) >= 4 else None
    if key is not None and (not isinstance(key, bytes) or len(key) != KEY_BYTES):
        raise FrameError(f"upload {storage_id} names a content key that is not {KEY_BYTES} bytes")
    possession = up[4] if len(up) >= 5 else None
    if possession is not None and (not isinstance(possession, bytes) or len(possession) != KEY_BYTES):
        raise FrameError(f"upload {storage_id} names a possession secret that is not {KEY_BYTES} bytes")
    packing = compress.parse_packing(up[5], nbytes, f"upload {storage_id}") if len(up) == 6 else None
    return storage_id, ex.devices[index], nbytes, key, possession, packing


def _wire_nbytes(spec: Upload) -> int:
    """The payload bytes an upload takes: its compressed size when packed."""
    return spec[5].wire_nbytes if spec[5] is not None else spec[2]


def receive(ex: Executor, header: FrameHeader, msg: dict[str, Any]) -> None:
    """Apply a BATCH's ``uploads`` (reading its payload) and ``cached`` entries, before its commands run."""
    uploads, cached = msg.get(BATCH_UPLOADS, []), msg.get(BATCH_CACHED, [])
    if not isinstance(cached, list):
        raise FrameError("a BATCH's 'cached' must be a list")
    reply_codec = msg.get("reply_codec")
    if reply_codec is not None and reply_codec not in compress.CODECS:
        raise FrameError(f"a BATCH's 'reply_codec' must be one of {list(compress.CODECS)}, got "
                         f"{str(reply_codec)[:40]!r}")
    # Only a codec this end has: a client asks for one the WELCOME listed, so another is sent uncompressed.
    ex.transfers.reply_codec = reply_codec if reply_codec in compress.available_codecs() else None
    if not (uploads or cached or header.payload_len):  # most batches: commands only
        return
    specs = [_parse_upload(ex, up, False) for up in uploads]
    hits = [_parse_upload(ex, up, True) for up in cached]
    total = sum(map(_wire_nbytes, specs))
    if total != header.payload_len:
        raise FrameError(f"uploads describe {total} payload bytes but the header says {header.payload_len}")
    if specs:
        _receive_sent(ex, header, specs, total)
    if hits:
        _adopt_cached(ex, hits)


def _refused_all(ex: Executor, specs: list[Upload], exc: Exception) -> None:

    for storage_id, *_ in specs:
        ex.store.poison(storage_id, str(exc))
    ex.defer(_error("upload", [[s[2]] for s in specs], "quota", str(exc), [s[0] for s in specs]))


def _receive_sent(ex: Executor, header: FrameHeader, specs: list[Upload], total: int) -> None:
    new = [(s, n) for s, _, n, _, _, _ in specs if s not in ex.store]
    try:
        ex.store.check_room(len(new), sum(n for _, n in new))
    except QuotaExceededError as exc:
        discard_payload(ex.channel, total)  # stay in step with the stream, then report the refusal on every storage
        _refused_all(ex, specs, exc)
        return
    transfers = ex.transfers
    cache = transfers.cache
    # A keyed upload the cache may keep lands in a new memfd; the rest in pooled or prefaulted memory.
    receivers = [Receiver(nbytes) if key is not None and cache is not None and cache.wants(nbytes) else None
                 for _, _, nbytes, key, _, _ in specs]
    # A large upload to a CUDA device goes through pinned staging in chunks, its copies overlapping the receive.
    chunked = [_chunked_staging(transfers, spec) if r is None else None for r, spec in zip(receivers, specs,
                                                                                         strict=True)]
    try:
        # An upload to a CUDA device lands in page-locked staging (genie/server/staging.py).
        buffers: list[Any] = [r.buffer if r is not None else None if c is not None
                              else _receive_buffer(transfers, device, nbytes)
                              for r, c, (_, device, nbytes, _, _, _) in zip(receivers, chunked, specs, strict=True)]
        for r in receivers:
            if r is not None:
                prefault(r.buffer)
        # A packed upload's bytes land in a buffer of their own, decompressed into the storage's memory after.
        wire = [torch.empty(s[5].wire_nbytes, dtype=torch.uint8) if s[5] is not None else b
                for s, b in zip(specs, buffers, strict=True)]
        _prefault_packed(specs, buffers)
        # New memory (a first upload of its size) is populated by a helper thread while the bytes arrive.
        with populated_ahead(*[w for w in wire if w is not None]):
            if not any(chunked):
                recv_payload(ex.channel, header.payload_len, [tensor_bytes(b) for b in wire])
            else:
                for i, staging in enumerate(chunked):
                    if staging is None:
                        recv_payload(ex.channel, wire[i].nbytes, [tensor_bytes(wire[i])])
                    else:
                        buffers[i] = _receive_chunked(ex, staging, specs[i])
        refused = _unpacked(ex, specs, wire, buffers)
        wire.clear()  # it holds the receivers' writable mappings too (unpacked uploads land in them): gone before sealing
        for i, received in enumerate(receivers):
            if received is not None:
                # The session gets a private (copy-on-write) mapping. The writable one goes first, here
                # as in the receiver: sealing against writes fails while any writable mapping is alive.
                buffers[i] = transfers.mapped(received.private(), specs[i][1])
                received.release()
        for (storage_id, device, nbytes, key, possession, _), raw, received in zip(specs, buffers, receivers,
                                                                                  strict=True):
            ex.metrics.record_bytes("in", nbytes, device)  # metrics
            if storage_id in refused or raw is None:
                continue  # poisoned, its error deferred (the cache keeps nothing of it), or written in place
            if received is not None and key is not None and cache is not None and received.seal():
                cache.keep(key, possession, received)  # the cache keeps the sealed file
            _apply_checked(ex, storage_id, device, raw)
    finally:
        for r in receivers:
            if r is not None:
                r.close()


def _chunked_staging(transfers: SessionTransfers, spec: Upload) -> CudaStaging | None:
    """The staging an upload goes through in chunks (a large, unpacked upload to a CUDA device), else None."""
    _, device, nbytes, _, _, packing = spec
    return staging_for(transfers, device) if packing is None and nbytes > CHUNKED_FROM else None


def _receive_chunked(ex: Executor, staging: CudaStaging, spec: Upload) -> torch.Tensor | None:
    """Receive one large upload to a CUDA device in chunks (CudaStaging.upload_stream): into its existing storage
    in place (returns None: nothing left to apply) or into new device memory (returned, for apply_upload). A
    refusal (a freed storage, another size) reads the bytes past and poisons the storage (returns None)."""
    storage_id, device, nbytes = spec[0], spec[1], spec[2]
    received = 0

    def receive(view: torch.Tensor) -> None:
        nonlocal received
        ex.channel.recv_into(tensor_bytes(view))
        received += view.numel()

    try:
        try:
            existing = ex.store.get(storage_id)  # StorageError for a freed id
        except RemoteExecutionError:
            existing = None  # poisoned: every byte is written again, so the storage is whole again
        if existing is not None and existing.nbytes() != nbytes:
            raise StorageError(f"upload of {nbytes} bytes into storage {storage_id}, which has {existing.nbytes()}; "
                               "an upload overwrites a whole storage of the same size")
        # In place where the storage is on this device; else received on it and copied over by apply_upload.
        into = torch.empty(0, dtype=torch.uint8, device=device).set_(existing) \
            if existing is not None and existing.device == device else None
        out = staging.upload_stream(nbytes, receive, into)
    except (ProtocolError, RemoteExecutionError, torch.OutOfMemoryError) as exc:
        discard_payload(ex.channel, nbytes - received)  # stay in step with the stream
        ex.store.poison(storage_id, str(exc))
        ex.defer(_error("upload", [[nbytes]], _kind_of(exc), str(exc), [storage_id]))
        return None
    return out if into is None else None


def _prefault_packed(specs: list[Upload], buffers: list[torch.Tensor]) -> None:
    """Populate the buffers packed uploads are decompressed into after the receive. (A function of its own: a
    loop variable left in the caller would keep a receiver's writable mapping alive, and sealing fails then.)"""
    for spec, buffer in zip(specs, buffers, strict=True):
        if spec[5] is not None:
            prefault(buffer)


def _unpacked(ex: Executor, specs: list[Upload], wire: list[torch.Tensor], buffers: list[torch.Tensor]) -> set[int]:
    """Decompress each packed upload of ``wire`` into its buffer (its declared size, which the quotas allowed);
    the storage ids refused (poisoned, the error deferred: the session goes on)."""
    refused: set[int] = set()
    for (storage_id, _, nbytes, _, _, packing), packed, buffer in zip(specs, wire, buffers, strict=True):
        if packing is None:
            continue
        what = f"compressed upload {storage_id} ({nbytes} bytes declared)"
        try:
            if storage_id in ex.store:
                size = ex.store.nbytes(storage_id)
                if size != nbytes:  # refused before decompressing, as apply_upload would after
                    raise StorageError(f"{what} into storage {storage_id}, which has {size}; an upload overwrites "
                                       "a whole storage of the same size")
            compress.unpack_into(tensor_bytes(packed), packing, buffer, what)
        except (ProtocolError, RemoteExecutionError) as exc:
            refused.add(storage_id)
            ex.store.poison(storage_id, str(exc))
            ex.defer(_error("upload", [[nbytes]], _kind_of(exc), str(exc), [storage_id]))
    return refused


def _apply_checked(ex: Executor, storage_id: int, device: torch.device, raw: torch.Tensor, *,
                   owned: bool = True) -> None:
    """:func:`apply_upload`, a failure poisoning the storage and deferred to the next reply."""

    try:
        apply_upload(ex, storage_id, device, raw, owned=owned)
    except (QuotaExceededError, ProtocolError, RemoteExecutionError) as exc:
        ex.store.poison(storage_id, str(exc))
        ex.defer(_error("upload", [[raw.numel()]], _kind_of(exc), str(exc), [storage_id]))


def apply_upload(ex: Executor, storage_id: int, device: torch.device, raw: torch.Tensor, *,
                 owned: bool = True) -> None:
    """Make ``raw``'s bytes all of storage ``storage_id``: adopt them (``owned``) or copy them in."""
    try:
        existing = ex.store.get(storage_id)  # StorageError for a freed id
    except RemoteExecutionError:
        existing = None  # poisoned: every byte is written again, so the storage is whole again
    if existing is None:
        if device.type != "cpu" and raw.device != device:  # (a chunked upload's bytes are on the device already)
            staging = staging_for(ex.transfers, device)  # pinned staging and a copy stream on CUDA
            raw = staging.upload(raw) if staging is not None else raw.to(device)
        elif not owned:
            ex.store.check_room(1, raw.numel())  # before the copy's memory is taken
            raw = ex.transfers.pool.take(raw.numel()).copy_(raw)
        ex.store.put(storage_id, raw.untyped_storage())
        return
    if existing.nbytes() != raw.numel():
        raise StorageError(f"upload of {raw.numel()} bytes into storage {storage_id}, which has "
                           f"{existing.nbytes()}; an upload overwrites a whole storage of the same size")
    torch.empty(0, dtype=torch.uint8, device=existing.device).set_(existing).copy_(raw)


def _adopt_cached(ex: Executor, hits: list[Upload]) -> None:

    reserved = ex.transfers.reserved
    for storage_id, device, nbytes, key, _, _ in hits:
        data = reserved.pop((key, nbytes), None) if key is not None else None
        if data is None:
            message = (f"cached upload {storage_id} names content that this session's last CMD_HAVE did not "
                       "report as held; ask CMD_HAVE first and upload the bytes on a miss")
            ex.store.poison(storage_id, message)
            ex.defer(_error("upload", [[nbytes]], "protocol", message, [storage_id]))
            continue
        if device.type != "cpu":
            ex.transfers.pool.skip.discard(data.data_ptr())  # copied to the device; the mapping goes
        _apply_checked(ex, storage_id, device, data)  # data: this session's own copy-on-write mapping


def have(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_HAVE, req, [[key, nbytes, proof or None], ...]]``: reply with one bool per key; reserve the hits.

    The first entries the session's budget allows are looked up (one round trip to the node's
    cache for all of them), the rest are answered as misses: the client sends their bytes.
    """
    if len(cmd) != 3 or not isinstance(cmd[2], list) or len(cmd[2]) > MAX_HAVE_KEYS:
        raise FrameError(f"HAVE must be [CMD_HAVE, req, [[key, nbytes, proof], ...]] with at most {MAX_HAVE_KEYS} keys")
    transfers = ex.transfers
    transfers.reserved = {}  # reservations last one batch: a client that never used them holds nothing
    entries: list[tuple[bytes, int, bytes | None]] = []
    for entry in cmd[2]:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], bytes)
                or len(entry[0]) != KEY_BYTES or not is_int(entry[1]) or not 0 <= entry[1] <= MAX_NBYTES
                or not (entry[2] is None or isinstance(entry[2], bytes))):
            raise FrameError(f"a HAVE entry must be [key ({KEY_BYTES} bytes), nbytes, proof or None], "
                             f"got {codec.preview(entry)}")
        entries.append((entry[0], int(entry[1]), entry[2]))
    asked = [e for e in entries if e[1] > 0] if transfers.cache is not None else []
    granted = transfers.have_budget.take(len(asked))
    if granted < len(asked):
        REFUSALS.warning("a session asked about %d content keys beyond its budget (%d at once, %g per second); "
                         "answered as misses", len(asked) - granted, transfers.have_budget.burst,
                         transfers.have_budget.rate)
    found = dict(zip(asked[:granted], transfers.cache.have(asked[:granted], transfers.nonce), strict=True)) \
        if transfers.cache is not None and granted else {}
    answers = []
    for key, nbytes, proof in entries:
        data = found.get((key, nbytes, proof))
        if data is not None:
            transfers.reserved[(key, nbytes)] = transfers.mapped(data)
        answers.append(data is not None)
    ex.reply(cmd[1], None, answers)


def fetch(ex: Executor, req: Any, device_index: Any, desc: Descriptor) -> None:
    """``CMD_FETCH``: reply with the described tensor's bytes, contiguous (compressed when the batch asked and
    they compress: the result's third element is then the packing)."""
    reply_codec, ex.transfers.reply_codec = ex.transfers.reply_codec, None

    try:
        ex.begin(device_index)
        out = ex.tensor(desc).resolve_conj().resolve_neg()
        give_back = _nothing
        chunked: CudaStaging | None = None
        if out.device.type != "cpu":
            staging = staging_for(ex.transfers, out.device)  # on CUDA: from pinned staging, copied on a copy stream
            if staging is not None and reply_codec is None and out.nbytes > CHUNKED_FROM:
                chunked = staging  # in chunks, each copy overlapping the send of the one before
            else:
                out, give_back = staging.download(out) if staging is not None else (out.cpu(), _nothing)
        out = out.contiguous()
    except Exception as exc:
        ex.reply(req, _error("fetch", [list(desc.sizes)], _kind_of(exc), _message(exc), []), None)
        return
    ex.metrics.record_bytes("out", out.nbytes, out.device)  # metrics
    result = codec.describe(0, out)[1:3]
    if chunked is not None:
        streaming = chunked
        ex.reply_in_parts(req, result, out.nbytes,
                          lambda part: streaming.download_stream(out, lambda chunk: part(tensor_bytes(chunk))))
        return
    packed = compress.pack(out.view(-1).view(torch.uint8), out.element_size()) \
        if reply_codec is not None and out.nbytes else None
    try:
        if packed is not None:
            ex.reply(req, None, [*result, packed[1].to_wire()], [memoryview(packed[0])])
            return
        ex.reply(req, None, result, [tensor_bytes(out)], keep=out)
    finally:
        give_back()  # the reply was sent: the staging buffer may serve the next download


def _nothing() -> None:
    pass
