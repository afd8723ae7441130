"""The client side of one data-plane session: batching, storages, sync points.

Ops are encoded on the calling thread and appended to a batch; the batch is sent
when it grows past a bound, at a sync point, or when the runtime's idle flusher
finds it waiting (so fire-and-forget work starts even if no sync point comes).
The bound adapts: small right after a sync point (the server is idle), doubling
with each batch while the server has work (see ``MIN_BATCH_CMDS``), unless the
connection measured that full batches from the start are faster on this machine
(:mod:`genie.device.flushing`).
A sync point sends the batch and its request in one frame and reads the reply on
the calling thread: one round trip, no thread hand-off. A lock serialises the
user's thread, autograd's device thread and the flusher.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from genie import _C
from genie.device import stats as stats_module
from genie.device.compression import OFF, CompressionPolicy, SessionCompression, negotiate
from genie.device.flushing import MEASURED_OPS, FlushChooser
from genie.device.resume import ResumeState, offer_of, recover
from genie.device.stats import STATS
from genie.device.transfers import ClientCache
from genie.errors import (
    ConnectionClosedError,
    FrameError,
    GenieError,
    ProtocolError,
    QuotaExceededError,
    RemoteDeviceLost,
    RemoteExecutionError,
    TransportError,
)
from genie.transport.base import Channel
from genie.transport.features import native_stream
from genie.transport.record import INLINE
from genie.wire import compress
from genie.wire import frame as wf
from genie.wire import messages as wm
from genie.wire.buffers import populated_ahead, prefault, tensor_bytes
from genie.wire.spec import BATCH_CACHED, BATCH_CMDS, BATCH_UPLOADS
from genie.wire.values import EXT_COMPLEX, EXT_DTYPE, EXT_LAYOUT, EXT_MEMORY_FORMAT, make_ext_hook, tensor_ext

log = logging.getLogger("genie.device")

MAX_BATCH_CMDS = 512
MAX_BATCH_BYTES = 1 << 20
#: The first batch after a sync point: the server has just answered everything, so it is idle, and a
#: small batch sets it to work while this thread encodes the next ones. Each later batch doubles the
#: bound up to MAX_BATCH_CMDS: by then the server is busy and bigger batches cost it fewer frames.
#: (512-command batches serialised the two sides: the server started late and ran the last batch
#: after the client had finished.) Set it to MAX_BATCH_CMDS for fixed-size batches.
MIN_BATCH_CMDS = 16

#: Uploads this large send the frees waiting before them first (genie.server.transfers.POOL_MIN_BYTES).
POOLED_UPLOAD_BYTES = 1 << 20

def _kept(_: Any) -> Any:
    raise AssertionError("unreachable: _reply_ext passes these tags on as they are")


_values = make_ext_hook(_kept, _kept, _kept)


def _reply_ext(code: int, data: bytes) -> Any:
    """The value tags a reply's result may hold: complex numbers (``.item()`` of a complex tensor), dtypes,
    layouts, memory formats; any other tag stays an ExtType, as it always did."""
    if code in (EXT_COMPLEX, EXT_DTYPE, EXT_LAYOUT, EXT_MEMORY_FORMAT):
        return _values(code, data)
    return msgpack.ExtType(code, data)


class NodeConnection:
    """One client's data-plane session with one node."""

    def __init__(self, channel: Channel, *, node_id: str, address: str, op_timeout: float = 60.0) -> None:
        self.channel = channel
        self.node_id = node_id
        self.address = address
        self.op_timeout = op_timeout
        self.devices: list[dict[str, Any]] = []
        self.limits: dict[str, Any] = {}
        #: genie._C's queue for this session: ops it encodes itself (genie/csrc/device/fastpath.cpp); room set by _room()
        self.qid: int = _C.queue_new()
        #: every send and receive of the session holds it; shared with genie._C's lane (genie/csrc/device/lane.cpp)
        self.lock = _C.SessionLock(self.qid)
        self._lane = False  # whether genie._C answers .item() on this session's channel itself
        self._cmds: list[bytes] = []
        self._cmd_bytes = 0
        self._uploads: list[list[Any]] = []
        self._payload: list[memoryview] = []
        self._keepalive: list[torch.Tensor] = []
        self.frees: list[int] = []
        #: (local device, generator id) -> the generator epoch the server was last seeded at
        self.seeded: dict[tuple[int, int], int] = {}
        self._lost: str | None = None
        self.last_send = time.monotonic()
        self.backend = "tcp"
        #: the node process's incarnation when the session opened (genie.cluster.nodes.restarted); "" unknown
        self.incarnation = ""
        self.encoder: Callable[[Any], Any] | None = None
        #: a sync point's command while it is being sent: the batch's last, after its frees (see _flush_locked)
        self._request_cmd: bytes | None = None
        #: commands that make a batch full now (adaptive: see MIN_BATCH_CMDS)
        self.flush_at = MIN_BATCH_CMDS
        #: small first batches or full ones after a sync point, measured (genie.device.flushing)
        self.flush_policy = FlushChooser()
        self._packer: msgpack.Packer | None = None
        self._packer_default: Callable[[Any], Any] | None = None
        self.stats = {"ops": 0, "bytes_up": 0, "bytes_down": 0, "round_trips": 0, "batches": 0, "bytes_cached": 0,
                      "bytes_packed": 0, "bytes_packed_wire": 0}
        #: the weight cache policy (``upload_cache``) and, after the handshake, the node's cache (or None)
        self.upload_cache = "params"
        self.content: ClientCache | None = None
        self._cached: list[list[Any]] = []
        #: compression (genie.device.compression): the configuration's policy; after the handshake, the session's
        self.compression_policy = CompressionPolicy()
        self.compression: SessionCompression = OFF
        self._reply_codec: str | None = None  # the codec a fetch's reply may come in, while its batch is sent
        self._early_deferred: list[Any] = []  # errors a CMD_HAVE reply carried, raised at the next sync point
        self._head = memoryview(bytearray(wf.HEADER.size))  # each reply's frame header (under the lock)
        #: torch's settings the node was told last (genie._C.session_options: deterministic algorithms, warn only)
        self._options = 0
        #: the torch.accelerator.Graph capture recording this session's ops (genie.device.graphs), or None
        self.capture: Any = None
        #: opens a new channel to the node (timeout in seconds): set by whoever connected, for resuming
        self.reconnect: Callable[[float], Channel] | None = None
        self.reconnect_window = 30.0  #: this client's longest wait for a resume (the node's may be shorter)
        #: the session's resume state after a WELCOME that offered it (genie.device.resume), else None
        self.resumable: ResumeState | None = None
        self._in_background = False  # the runtime thread is sending (try_flush, keepalive): it never resumes
        self._broken: str | None = None  # why a background send failed: the next send resumes first

    # -- handshake ---------------------------------------------------------------------------
    def handshake(self, hello: dict[str, Any], timeout: float, *, token: bytes = b"") -> dict[str, Any]:
        """HELLO (-> CHALLENGE -> AUTH) -> WELCOME, see genie.wire.handshake; the token never crosses the wire.

        A refused token raises AuthenticationError, any other REJECT HandshakeError with the server's reason.
        """
        from genie.wire.handshake import client_handshake

        with self.lock:
            self.channel.settimeout(timeout)
            hello = {**hello, "codecs": list(compress.available_codecs())}  # what this client decompresses with
            if self.reconnect is not None and self.reconnect_window > 0:
                hello = {**hello, "resumable": True}  # this client reconnects after a drop (genie.wire.resume)
            reply = client_handshake(self.channel, hello, token=token, where=f"node {self.node_id} at {self.address}")
            self.devices = list(reply.get("devices", []))
            self.limits = dict(reply.get("limits", {}))
            self.node_id = str(reply.get("node_id", self.node_id))
            self.content = ClientCache.from_welcome(reply.get("cache"), self.upload_cache)
            self.compression = negotiate(self.compression_policy, reply, channel=self.channel, backend=self.backend,
                                         address=self.address, where=f"node {self.node_id} at {self.address}")
            self.channel.settimeout(self.op_timeout)
            offer = offer_of(reply, self.reconnect_window) if self.reconnect is not None else None
            # a TCP stream, plain or TLS (the transport's reconnect): what a resume reconnects
            if offer is not None and self.reconnect is not None:
                self.resumable = ResumeState(offer[0], window=offer[1], hello=hello, token=token,
                                             reconnect=self.reconnect)
            self._start_lane()
            return reply

    def _start_lane(self) -> None:
        """Let genie._C answer ``.item()`` over this channel's stream itself, where the channel offers it
        (``native_stream``: plain TCP and shared memory; TLS and the RDMA and DPDK paths do not)."""
        stream = native_stream(self.channel)
        if stream is not None:
            fd, records = stream
            _C.set_lane_wire(wf.PROTOCOL_VERSION, int(wf.MsgKind.BATCH), int(wf.MsgKind.REPLY), wm.CMD_FREE, INLINE,
                             wf.MAX_BODY_BYTES)
            _C.set_lane_places(stats_module._outside, stats_module.is_outside)
            _C.queue_lane(self.qid, fd, records, self)
            self._lane = True
            STATS.add_folder(self.fold_books)

    def restart_lane(self) -> None:
        """The channel was replaced (a resume): the lane answers ``.item()`` over the new one."""
        if self._lane:
            stream = native_stream(self.channel)
            _C.queue_lane(self.qid, stream[0] if stream is not None else -1, False, self)
            self._lane = stream is not None

    # -- state -------------------------------------------------------------------------------
    @property
    def lost(self) -> str | None:
        """Why this node is lost, or None while it is reachable."""
        return self._lost

    def mark_lost(self, reason: str) -> None:
        """Declare the node lost (a failed sync point, or the runtime's failure detector)."""
        if self._lost is None:
            self._lost = reason
            if self.resumable is not None:  # a resume under way on another thread ends now (genie.device.resume)
                self.resumable.stop(reason)
            _C.queue_room(self.qid, 0, 0)  # every op goes through Python now, which raises
            log.warning("node %s at %s lost: %s", self.node_id, self.address, reason)
            try:
                self.channel.close()
            except Exception:  # closing a broken channel may fail again; it is gone either way
                pass

    def _device_lost(self, device: str = "") -> RemoteDeviceLost:
        return RemoteDeviceLost(
            f"remote device {device or 'on node ' + self.node_id} is lost: node {self.node_id} at "
            f"{self.address} ({self._lost}); its tensors are gone",
            node_id=self.node_id,
            device=device,
        )

    def check_alive(self, device: str = "") -> None:
        if self._lost is not None:
            raise self._device_lost(device)

    # -- fire-and-forget -----------------------------------------------------------------------
    def op(self, device: int, name: str, args: Any, kwargs: Any, outs: list[Any],
           default: Callable[[Any], Any]) -> None:
        """Queue an op on local device ``device`` whose output descriptors the client already made."""
        with self.lock:
            if self.capture is not None:  # torch.accelerator.Graph capture: recorded, not sent
                self.capture.record(device, name, args, kwargs, outs)
                return
            packer = self._packer
            if packer is None or self._packer_default is not default:
                # One Packer per session: msgpack.packb builds a new one per call (a measurable share
                # of the per-op cost). Used under the lock: a Packer is not thread-safe.
                packer = self._packer = msgpack.Packer(use_bin_type=True, default=default)
                self._packer_default = default
            if self._lost is not None:
                self.queue(b"")  # dropped inside backward, else RemoteDeviceLost (see queue)
                return
            self._pull()
            cmd = packer.pack([wm.CMD_OP, device, name, args, kwargs, outs])
            self._cmds.append(cmd)  # queue()'s work inline: this is the per-op path
            self._cmd_bytes += len(cmd)
            self.stats["ops"] += 1
            STATS.op_queued()  # stats
            if len(self._cmds) >= self.flush_at or self._cmd_bytes >= MAX_BATCH_BYTES:
                self._flush_locked()
            else:
                self._room()

    def command(self, cmd: list[Any]) -> None:
        """Queue a command of plain values (CMD_SEED, CMD_RESIZE)."""
        if self.capture is not None and cmd[0] != wm.CMD_SEED:  # a seed is state, set before the replays
            raise self.capture.refuse("a storage resize")
        self.queue(msgpack.packb(cmd, use_bin_type=True))

    def queue(self, cmd: bytes) -> None:
        """Queue an encoded command.

        Inside autograd's backward an exception on this device would cross a ``noexcept`` in
        torch's Python device guard and abort the process, so a lost node's commands are
        dropped there instead; the next sync point raises RemoteDeviceLost.
        """
        with self.lock:
            if self._lost is not None and torch._C._current_graph_task_id() != -1:
                return
            self.check_alive()
            self._pull()
            self._append(cmd)
            self.stats["ops"] += 1
            STATS.op_queued()  # stats

    def upload(self, storage_id: int, device: int, src: torch.Tensor, *, overwrite: bool, by_key: bool = False) -> None:
        """Queue a contiguous CPU tensor's bytes as all of storage ``storage_id`` on local device ``device``.

        Uploads run before the commands of their batch, so an upload that may ``overwrite`` a
        storage earlier commands still read first sends those commands in a batch of their own.
        ``by_key``: name the bytes by content key first (the weight cache, genie.device.transfers).
        """
        if self.capture is not None:
            raise self.capture.refuse(f"a host-to-device copy of {src.nbytes} bytes")
        view = tensor_bytes(src)
        content = self.content
        if by_key and content is not None and view.nbytes >= content.min_bytes:
            candidate = content.hold(storage_id, device, src, view)
            with self.lock:
                self.check_alive()
                self._pull()
                if overwrite and (self._cmds or self._writes_pending(storage_id)):
                    self._flush_locked()
                if content.add(candidate):
                    self._flush_locked()
                else:
                    self._room()  # the held-back upload goes with the next batch: never without it
            return
        packed = self.compression.pack(src, view.nbytes)  # before the lock: compressing takes a while
        with self.lock:
            self.check_alive()
            self._pull()
            if overwrite and (self._cmds or content is not None and content.holds(storage_id)):
                self._flush_locked()
            elif view.nbytes >= POOLED_UPLOAD_BYTES:
                # Frees run after their batch's uploads: send them first, so the node can receive this
                # upload into the memory of a storage just freed (its staging pool: no page faults).
                self.frees.extend(_C.queue_frees(self.qid))
                if self.frees:
                    self._flush_locked()
            if packed is None:
                if self._cmd_bytes + view.nbytes < MAX_BATCH_BYTES and view.nbytes:
                    # Sent later, with its batch: keep the bytes as they are now. CUDA's .to() copies a pageable
                    # source before it returns, and callers change their tensor in place right after
                    # (embedding_bag(max_norm=...) renormalized a CPU weight that a queued upload still read).
                    src = src.clone()
                    view = tensor_bytes(src)
                self._uploads.append([storage_id, device, view.nbytes])
                self._payload.append(view)
            else:
                self._uploads.append([storage_id, device, view.nbytes, None, None, packed[1].to_wire()])
                self._payload.append(memoryview(packed[0]))
                self._packed(view.nbytes, packed[1].wire_nbytes)
            self._keepalive.append(src)
            self.stats["bytes_up"] += view.nbytes
            STATS.uploaded(view.nbytes)  # stats
            self._cmd_bytes += view.nbytes if packed is None else packed[1].wire_nbytes
            if self._cmd_bytes >= MAX_BATCH_BYTES:
                self._flush_locked()
            else:
                self._room()

    def _packed(self, nbytes: int, wire_nbytes: int) -> None:
        """A transfer of ``nbytes`` went compressed, as ``wire_nbytes``."""
        self.stats["bytes_packed"] += nbytes
        self.stats["bytes_packed_wire"] += wire_nbytes

    def _writes_pending(self, storage_id: int) -> bool:
        """Whether a queued or held-back upload writes ``storage_id`` (a later one must not overtake it)."""
        return any(u[0] == storage_id for u in self._uploads) or (self.content is not None
                                                                 and self.content.holds(storage_id))

    def _append(self, cmd: bytes) -> None:
        self._cmds.append(cmd)
        self._cmd_bytes += len(cmd)
        if len(self._cmds) >= self.flush_at or self._cmd_bytes >= MAX_BATCH_BYTES:
            self._flush_locked()
        else:
            self._room()

    def _pull(self) -> None:
        """Take the commands genie._C queued for this session (in order: before anything Python queues now),
        after the books its lane kept."""
        if self._lane:
            self._fold_books()
        native = _C.queue_take(self.qid)
        if native is not None:
            self._cmds.extend(native)
            self._cmd_bytes += sum(map(len, native))
            self.stats["ops"] += len(native)
            STATS.op_queued(len(native))  # stats
        options = _C.session_options()
        if options != self._options:
            self._tell_options(options)

    def _tell_options(self, options: int) -> None:
        """Tell the node torch's settings changed (``torch.use_deterministic_algorithms``): a CMD_OPTIONS after
        the commands queued under the old ones, before any queued under the new. genie._C queues ops natively
        only while torch's settings equal what the node was told, so none can slip past this."""
        cmd = msgpack.packb([wm.CMD_OPTIONS, {"deterministic": bool(options & 1), "warn_only": bool(options & 2)}])
        self._cmds.append(cmd)
        self._cmd_bytes += len(cmd)
        self._options = options
        _C.queue_options(self.qid, options)

    def _room(self) -> None:
        """Tell genie._C how many commands may still join the batch natively before it must be sent, and
        whether its lane may send the batch (nothing of Python's waits for it, the channel is at rest) and
        keep the books of its round trip itself (see fold_books)."""
        if self.capture is not None:  # a graph capture records every op: none may be queued natively
            _C.queue_room(self.qid, 0, 0)
            return
        if self._lost is None:
            if not self._lane:
                _C.queue_room(self.qid, self.flush_at - len(self._cmds) - 1, MAX_BATCH_BYTES - self._cmd_bytes)
                return
            policy = self.flush_policy
            after_sync = MIN_BATCH_CMDS if policy.choice == "small" else MAX_BATCH_CMDS
            _C.queue_room(self.qid, self.flush_at - len(self._cmds) - 1, MAX_BATCH_BYTES - self._cmd_bytes,
                          self._clean(), policy.unmeasured_left(self.stats["ops"]), MEASURED_OPS - 1, after_sync - 1,
                          MAX_BATCH_BYTES)

    def fold_books(self) -> None:
        """Fold in the books of the round trips genie._C's lane kept itself (``.item()`` sync points that end
        intervals the batching policy does not measure): this session's counts, the process's statistics
        (with each one's line), the policy's last sync point, the next batch's bound."""
        with self.lock:
            if self._lane:
                self._fold_books()

    def _fold_books(self) -> None:
        books = _C.queue_books(self.qid)
        if books is None:
            return
        trips, ops, seconds, last_end, places = books
        if self.resumable is not None:
            self.resumable.log.answered(trips)
        stats = self.stats
        stats["ops"] += ops
        stats["batches"] += trips
        stats["round_trips"] += trips
        STATS.lane_books(ops, trips, seconds, places)  # stats
        self.flush_policy.restarted(last_end, stats["ops"])
        self.flush_at = MIN_BATCH_CMDS if self.flush_policy.choice == "small" else MAX_BATCH_CMDS
        self.last_send = max(self.last_send, last_end)

    def _clean(self) -> bool:
        content = self.content
        return not (self._cmds or self._uploads or self.frees or self._cached or self._early_deferred
                    or self._request_cmd is not None or content is not None and content.pending) \
            and self._lane_channel().at_rest()

    # -- sending -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send whatever is queued (the idle flusher calls this)."""
        with self.lock:
            if self._lost is None:
                self._flush_locked()

    def try_flush(self) -> None:
        """Flush unless another thread holds the session (the runtime loop must never block here).

        Uploads held back for the weight cache wait for a user thread's flush: asking the node
        about them is a round trip, which the runtime loop must not wait for.
        """
        if self.content is not None and self.content.pending:
            return
        if self.lock.acquire(blocking=False):
            try:
                if self._lost is None:
                    self._in_background = True  # a dropped link is resumed by the next user thread, not here
                    self._flush_locked()
            except GenieError:
                pass
            finally:
                self._in_background = False
                self.lock.release()

    def keepalive(self, idle: float) -> None:
        """Send an empty batch when nothing went out for ``idle`` seconds, so the server's
        ``session_idle_timeout`` never closes a session whose user still holds tensors.
        Never blocks: skipped while another thread holds the session."""
        if self._lost is None and time.monotonic() - self.last_send > idle and self.lock.acquire(blocking=False):
            try:
                self._in_background = True  # a dropped link is resumed by the next user thread, not here
                self._send_batch(msgpack.packb({BATCH_UPLOADS: [], BATCH_CMDS: []}))
                self.last_send = time.monotonic()
            except GenieError:
                pass
            finally:
                self._in_background = False
                self.lock.release()

    def has_pending(self) -> bool:
        return bool(self._cmds or self._uploads or self.frees or self.content is not None and self.content.pending
                    or _C.queue_count(self.qid))

    def _flush_locked(self) -> None:
        if self.content is not None and self.content.pending:
            self._ask_cache()
        # Frees first, then the native queue: an op that used a storage freed by now was queued before the
        # storage was freed, so it is among the commands taken after (other threads queue natively without
        # this lock: taken the other way round, a FREE could overtake their op into this batch).
        self.frees.extend(_C.queue_frees(self.qid))
        self._pull()
        if self.frees:
            # After the queued commands: a storage is freed only once no queued op can still use it...
            frees, self.frees = self.frees, []
            self._cmds.append(msgpack.packb([wm.CMD_FREE, frees]))
        request = self._request_cmd
        if request is not None:  # ...but before a request, so it is answered last
            self._request_cmd = None
            self._cmds.append(request)
        if not self._cmds and not self._uploads and not self._cached:
            self._room()
            return
        batch: dict[str, Any] = {BATCH_UPLOADS: self._uploads, BATCH_CMDS: self._cmds}
        if self._cached:
            batch[BATCH_CACHED] = self._cached
        if self._reply_codec is not None and request is not None:  # the request is a fetch whose reply may compress
            batch["reply_codec"] = self._reply_codec
        body = msgpack.packb(batch, use_bin_type=True)
        payload = self._payload
        try:
            self._send_batch(body, payload, awaiting=request is not None)
        except (TransportError, OSError) as exc:
            self.mark_lost(f"send failed: {exc}")
            raise self._device_lost() from exc
        finally:
            self._cmds, self._uploads, self._payload, self._keepalive, self._cached = [], [], [], [], []
            self._cmd_bytes = 0
        self.last_send = time.monotonic()
        self.flush_at = min(self.flush_at * 2, MAX_BATCH_CMDS)  # the server has work now: grow
        if request is None:  # a request sets the room once its reply is in
            self._room()
        self.stats["batches"] += 1
        STATS.batch_sent()  # stats

    def _send_batch(self, body: bytes, payload: list[memoryview] | tuple[()] = (), *, awaiting: bool = False) -> None:
        """Send a BATCH frame; in a resumable session numbered and kept until acknowledged, and a failed send
        resumes the session (``awaiting``: the batch ends with a request) or raises RemoteDeviceLost."""
        state = self.resumable
        if state is None:
            wf.send_frame(self.channel, wf.MsgKind.BATCH, body, payload)
            return
        if self._lane:
            self._fold_books()  # the lane's batches came first: their numbers before this one's
        if self._broken is not None and not self._in_background:  # a background send found the link dropped
            reason, self._broken = self._broken, None
            recover(self, reason, awaiting=False)
        parts = [wf.encode_header(wf.MsgKind.BATCH, len(body), sum(p.nbytes for p in payload)), body, *payload]
        state.log.sending(parts)
        if self._broken is not None:  # in the background, the link known dropped: kept for the resume
            return
        try:
            self.channel.sendv(parts)
        except (TransportError, OSError) as exc:
            if self._in_background:  # the runtime thread never waits for a resume; the batch is kept
                self._broken = f"send failed: {exc}"
                return
            recover(self, f"send failed: {exc}", awaiting=awaiting)

    def _recv_reply(self, device: str) -> tuple[wf.MsgKind, bytearray, int]:
        """The next frame's header and body (a reply); a resumable session resumes when the link dropped."""
        while True:
            try:
                return wf.recv_frame(self.channel, self._head)
            except (ConnectionClosedError, TimeoutError, OSError) as exc:
                if self.resumable is None:
                    self.mark_lost(f"no answer: {exc}")
                    raise self._device_lost(device) from exc
                recover(self, f"no answer: {exc}", awaiting=True, device=device)
            except FrameError as exc:
                self.mark_lost(f"no answer: {exc}")
                raise self._device_lost(device) from exc

    # -- sync points ---------------------------------------------------------------------------
    def _request(self, command: list[Any], default: Callable[[Any], Any] | None = None,
                 payload_into: Callable[[Any], torch.Tensor | None] | None = None, device: str = "",
                 reply_codec: str | None = None) -> Any:
        """Send the batch with ``command`` last (its second element becomes the request id) and read the reply
        (``reply_codec``: a fetch's reply may come compressed with it).

        This is every sync point's path but ``.item()``'s, which genie._C's lane takes while it can (see
        _start_lane); kept to the few steps a round trip needs (docs/benchmarks.md, where the tiny round
        trip goes).
        """
        with self.lock:
            if self._lost is not None:
                raise self._device_lost(device)
            if self.capture is not None:
                what = {wm.CMD_FETCH: "a download (.cpu(), printing)", wm.CMD_SYNC: "synchronize()"}.get(command[0])
                if command[0] == wm.CMD_CALL:
                    what = f"{command[3]!s:.80} (its result is a number or a data-dependent shape)"
                raise self.capture.refuse(f"a sync point, {what or 'a round trip'},")
            req = command[1] = _C.queue_request_id(self.qid)
            started = time.perf_counter()  # stats
            self._request_cmd = msgpack.packb(command, use_bin_type=True, default=default)
            self._reply_codec = reply_codec
            try:
                self._flush_locked()
            finally:
                self._request_cmd = self._reply_codec = None
            kind, body, payload_len = self._recv_reply(device)
            return self._finish(req, command, started, kind, body, payload_len, payload_into, device)

    def _finish(self, req: int, command: list[Any], started: float, kind: wf.MsgKind, body: bytes | bytearray,
                payload_len: int, payload_into: Callable[[Any], torch.Tensor | None] | None, device: str) -> Any:
        """The reply to request ``req`` came (its header read, ``body`` its body; under the lock): its
        payload into ``payload_into``'s tensor, the statistics, the next batch's bound, the node's errors
        raised; returns the result (or the tensor the payload went to)."""
        if self._lane:
            self._fold_books()
        try:
            if kind != wf.MsgKind.REPLY:
                self._refused(kind, body, device)
            reply = wf.unpack_body(body, _reply_ext)
            if type(reply) is not list or len(reply) != 4 or reply[0] != req:
                raise ProtocolError(f"node {self.node_id} sent a reply out of step: {str(reply)[:200]}")
            _, error, result, deferred = reply
            out = None
            if payload_len:
                out = self._download(payload_len, payload_into, result, error)
        except (ConnectionClosedError, TimeoutError, OSError, FrameError) as exc:
            if self.resumable is None or isinstance(exc, FrameError) or self._lost is not None:
                self.mark_lost(f"no answer: {exc}")
                raise self._device_lost(device) from exc
            # The link dropped inside the reply's payload: the node sends the whole reply again after the resume.
            recover(self, f"no answer: {exc}", awaiting=True, device=device)
            kind, body, payload_len = self._recv_reply(device)
            return self._finish(req, command, started, kind, body, payload_len, payload_into, device)
        if self.resumable is not None:
            self.resumable.log.answered()
        self._replied(command, started, payload_len)
        if self._early_deferred:
            deferred, self._early_deferred = [*self._early_deferred, *deferred], []
        self._room()
        if deferred:
            raise _execution_error(deferred[0], more=len(deferred) - 1)
        if error is not None:
            raise _execution_error(error)
        return out if payload_into is not None else result

    def _replied(self, command: list[Any], started: float, payload_len: int) -> None:
        """A request's reply came: the round trip's statistics and the next batch's bound."""
        stats = self.stats
        stats["round_trips"] += 1
        # Everything sent has run: the server is idle again. Start small (or full, where that measured faster).
        small = self.flush_policy.interval_done(stats["ops"], time.perf_counter()) == "small"
        self.flush_at = MIN_BATCH_CMDS if small else MAX_BATCH_CMDS
        STATS.round_trip(command, started, payload_len)  # stats

    # -- the lane's replies (genie/csrc/device/lane.cpp calls these with the session lock held) -----------------
    # lane_done, lane_reply, lane_resume and lane_failed are all the lane reads of this class: public, since
    # C++ reads no private Python name (tests/test_privates.py).
    def _lane_channel(self) -> Any:
        """The channel, with the lane's optional methods (genie.transport.base.Channel)."""
        return self.channel

    def _lane_sent(self, taken: int, failed: bytes = b"") -> None:
        """What a flush records, for the batch the lane sent with ``taken`` commands genie._C had queued
        (after the books of the round trips the lane kept before it, so the policy's interval counts them);
        a resumable session numbers it, answered, or kept (the frame ``failed``) for a resend."""
        self._fold_books()
        if self.resumable is not None:
            if failed:
                self.resumable.log.sending([failed])
            else:
                self.resumable.log.answered(1)
        self.stats["ops"] += taken
        STATS.op_queued(taken)  # stats
        self.stats["batches"] += 1
        STATS.batch_sent()  # stats
        self.last_send = time.monotonic()

    def lane_done(self, taken: int, started: float) -> None:
        """The lane's ``.item()`` was answered with a number and nothing else (lane.cpp checked the reply as
        _finish would), in an interval the batching policy measures: its bookkeeping, as _finish keeps it."""
        self._lane_sent(taken)
        self._replied(_lane_command(0), started, 0)
        self._room()

    def lane_reply(self, req: int, started: float, taken: int, device: int, head: bytes, body: bytes | None,
                    leftover: bytes) -> Any:
        """The lane sent ``.item()``'s request ``req`` and read the reply frame (``head`` and ``body``;
        ``leftover``: stream bytes past it, which the channel gives first)."""
        with self.lock:
            self._lane_sent(taken)
            if leftover:
                self._lane_channel().unread(leftover)
            label = device_label(device)
            try:
                kind, _, payload_len = wf.check_header(head)
            except FrameError as exc:
                self.mark_lost(f"no answer: {exc}")
                raise self._device_lost(label) from exc
            assert body is not None  # the lane reads the body of every header that passes the checks
            return self._finish(req, _lane_command(req), started, kind, body, payload_len, None, label)

    def lane_resume(self, req: int, started: float, taken: int, device: int, partial: bytes, record_kind: int,
                     record_len: int) -> Any:
        """The lane sent request ``req``; the reply goes on in a record only the channel reads: ``partial``
        is the frame so far, then the record (``record_kind``, ``record_len``) whose header the lane read."""
        with self.lock:
            self._lane_sent(taken)
            label = device_label(device)
            try:
                self._lane_channel().resume_record(partial, record_kind, record_len)
                kind, body, payload_len = wf.recv_frame(self.channel, self._head)
            except (ConnectionClosedError, TimeoutError, OSError, FrameError) as exc:
                self.mark_lost(f"no answer: {exc}")
                raise self._device_lost(label) from exc
            return self._finish(req, _lane_command(req), started, kind, body, payload_len, None, label)

    def lane_failed(self, req: int, started: float, taken: int, device: int, reason: str, frame: bytes = b"") -> Any:
        """The lane's send or receive of request ``req`` (its BATCH ``frame``) failed: a resumable session
        resumes and returns the reply's result; otherwise the node is lost."""
        with self.lock:
            label = device_label(device)
            if self.resumable is not None and frame and self._lost is None:
                self._lane_sent(taken, frame)
                recover(self, f"no answer: {reason}", awaiting=True, device=label)
                kind, body, payload_len = self._recv_reply(label)
                return self._finish(req, _lane_command(req), started, kind, body, payload_len, None, label)
            self._lane_sent(taken)
            self.mark_lost(f"no answer: {reason}")
            raise self._device_lost(label)

    def _refused(self, kind: wf.MsgKind, body: bytes | bytearray, device: str) -> None:
        """A frame other than the reply: the node ended the session (an ERROR frame says why)."""
        text = wf.unpack_body(body) if body else {}
        reason = text.get("reason", text) if isinstance(text, dict) else text
        self.mark_lost(f"the node closed the session: {reason}")
        if isinstance(text, dict) and text.get("code") == "lost":  # its worker died or was killed
            raise self._device_lost(device)
        if isinstance(text, dict) and text.get("code") == "quota":
            raise QuotaExceededError(f"node {self.node_id} closed this session: {reason}")
        raise ProtocolError(f"node {self.node_id} sent {kind.name} instead of a reply: {reason}")

    def _download(self, nbytes: int, payload_into: Callable[[Any], torch.Tensor | None] | None, result: Any,
                  error: Any) -> torch.Tensor | None:
        """Receive a reply's payload into the tensor ``payload_into`` names (or drop it)."""
        out = payload_into(result) if payload_into and error is None else None
        if out is None:
            wf.discard_payload(self.channel, nbytes)
            return None
        packing = result[2] if isinstance(result, list) and len(result) == 3 else None
        if packing is None:
            # Usually fresh memory (.cpu()'s result): its pages are populated by a helper while the bytes arrive.
            with populated_ahead(out):
                wf.recv_payload(self.channel, nbytes, [tensor_bytes(out)])
            self.stats["bytes_down"] += nbytes
            return out
        prefault(out)  # decompressed into at the end: populated in one call, not a fault per page
        wire = bytearray(nbytes)
        wf.recv_payload(self.channel, nbytes, [memoryview(wire)])  # all of it first: the stream stays in step
        what = f"node {self.node_id}'s compressed fetch reply"
        packed = compress.parse_packing(packing, out.nbytes, what)
        if packed.wire_nbytes != nbytes:
            raise ProtocolError(f"{what} says {packed.wire_nbytes} bytes but its payload has {nbytes}")
        compress.unpack_into(wire, packed, out.detach().reshape(-1).view(torch.uint8), what)
        self._packed(out.nbytes, nbytes)
        self.stats["bytes_down"] += out.nbytes
        return out

    def _ask_cache(self) -> None:
        """One CMD_HAVE round trip for the uploads held back: hits go out as ``cached``, misses with their bytes."""
        assert self.content is not None
        candidates = self.content.take()
        req = _C.queue_request_id(self.qid)
        started, command = time.perf_counter(), [wm.CMD_HAVE, req, self.content.question(candidates)]  # stats
        body = msgpack.packb({BATCH_UPLOADS: [], BATCH_CMDS: [msgpack.packb(command, use_bin_type=True)]}, use_bin_type=True)
        try:
            self._send_batch(body, awaiting=True)
            kind, reply_body, payload_len = self._recv_reply("")
            if kind != wf.MsgKind.REPLY or payload_len:
                raise FrameError(f"node {self.node_id} answered CMD_HAVE with a {kind.name} frame")
            reply = wf.unpack_body(reply_body)
        except (ConnectionClosedError, TimeoutError, OSError, FrameError, TransportError) as exc:
            self.mark_lost(f"no answer: {exc}")
            raise self._device_lost() from exc
        if self.resumable is not None:
            self.resumable.log.answered()
        if not (isinstance(reply, list) and len(reply) == 4 and reply[0] == req and isinstance(reply[2], list)
                and len(reply[2]) == len(candidates)):
            self.mark_lost("a CMD_HAVE reply out of step")
            raise ProtocolError(f"node {self.node_id} sent a CMD_HAVE reply out of step: {str(reply)[:200]}")
        self.stats["round_trips"] += 1
        STATS.round_trip(command, started, 0)  # stats
        self._early_deferred.extend(reply[3] or ())
        for candidate, hit in zip(candidates, reply[2], strict=True):
            entry = [candidate.storage_id, candidate.device, candidate.view.nbytes, candidate.key]
            if hit is True:
                self._cached.append(entry)
                self.stats["bytes_cached"] += candidate.view.nbytes
                continue
            packed = self.compression.pack(candidate.src, candidate.view.nbytes)
            if packed is None:
                self._uploads.append([*entry, candidate.possession])  # the node keeps the bytes under key, possession
                self._payload.append(candidate.view)
            else:
                self._uploads.append([*entry, candidate.possession, packed[1].to_wire()])
                self._payload.append(memoryview(packed[0]))
                self._packed(candidate.view.nbytes, packed[1].wire_nbytes)
            self._keepalive.append(candidate.src)
            self.stats["bytes_up"] += candidate.view.nbytes
            STATS.uploaded(candidate.view.nbytes)  # stats

    def fetch(self, local: int, desc: list[Any], out: torch.Tensor, device: str = "") -> torch.Tensor:
        """Download the described tensor's values into ``out`` (a contiguous CPU tensor of its dtype and shape)."""
        codec = self.compression.codec if self.compression.wants(out.nbytes) else None
        return self._request([wm.CMD_FETCH, 0, local, tensor_ext(desc)], payload_into=lambda _: out, device=device,
                             reply_codec=codec)

    def call(self, local: int, name: str, args: Any, kwargs: Any, out_ids: list[int],
             default: Callable[[Any], Any], device: str = "") -> Any:
        """Run an op now and return its result (tensors as descriptors over the storages ``out_ids``)."""
        return self._request([wm.CMD_CALL, 0, local, name, args, kwargs, out_ids], default=default, device=device)

    def sync(self) -> None:
        """Wait until everything sent so far has run; raise the first deferred error."""
        self._request([wm.CMD_SYNC, 0])

    def request(self, command: list[Any], default: Callable[[Any], Any] | None = None, device: str = "") -> Any:
        """Send ``command`` (its second element becomes the request id) after the batch; its reply's result.

        For commands of other modules that answer (genie.distributed's CMD_DIST_HOST, CMD_DIST_WAIT).
        """
        return self._request(command, default=default, device=device)

    def close(self) -> None:
        """Say goodbye (best effort) and close the channel.

        A resume under way on another thread (which holds the lock) ends first, and none starts here: closing
        never waits out a reconnect window."""
        if self.resumable is not None:
            self.resumable.stop("this client closed the session (genie.shutdown())")
        with self.lock:
            if self._lost is None:
                try:
                    self._flush_locked()
                    wf.send_frame(self.channel, wf.MsgKind.GOODBYE, wf.pack_body({}))
                except GenieError:
                    pass
            self._lost = self._lost or "closed by this client"
            if self._lane:
                self._fold_books()
                _C.queue_lane(self.qid, -1, False, None)
                self._lane = False
            _C.queue_drop(self.qid)
            self.channel.close()


def _lane_command(req: int) -> list[Any]:
    """What the statistics name a lane's request by (genie.device.stats.command_reason)."""
    return [wm.CMD_CALL, req, 0, "aten::_local_scalar_dense"]


def device_label(device: int) -> str:
    """The name of global device ``device`` in errors (genie.device.registry.RemoteDevice.label)."""
    return f"remote_accelerator:{device}"


def _execution_error(info: Any, more: int = 0) -> GenieError:
    if not isinstance(info, dict):
        return RemoteExecutionError(f"the server reported an error: {info!r}")
    shapes = info.get("shapes")
    where = f"{info.get('op', '?')}"
    if shapes:
        where += f" with input shapes {shapes}"
    suffix = f" ({more} more errors after it)" if more > 0 else ""
    kind = info.get("kind", "execution")
    message = f"remote {where} failed on the server: {info.get('message', '')}{suffix}"
    if kind == "quota":
        from genie.errors import QuotaExceededError

        return QuotaExceededError(message)
    if kind == "forbidden":
        from genie.errors import ForbiddenOpError

        return ForbiddenOpError(message)
    if kind == "lost":  # a peer the command needed went away (a copy between nodes: genie.server.peer_copy)
        return RemoteDeviceLost(message)
    return RemoteExecutionError(message)
