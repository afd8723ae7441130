"""Runs one session's batches: uploads, ops, calls, fetches, frees, seeds, resizes and syncs.

The executor belongs to one session and runs on that session's thread, so the
commands of a session run in the order the client sent them. It keeps the
session's storages (:class:`~genie.server.store.StorageStore`) and builds the
tensors a command describes over them, checking every descriptor's bounds. It
never trusts the client's metadata: every op output is checked against what the
client computed with meta tensors (:mod:`genie.server.outputs`).

Errors are of two sorts. A frame or command that breaks the wire rules raises
:class:`~genie.errors.FrameError` and the session closes the connection. A
command that is well formed but fails (an op raises, a storage is freed or
poisoned, a descriptor leaves its storage, an op is forbidden, a quota is hit)
becomes a *deferred error*: a map ``{"op", "shapes", "kind", "message",
"storages"}`` carried by the next reply, with the command's output storages
poisoned so later uses name the root cause. ``kind`` is one of ``execution``,
``mismatch``, ``forbidden``, ``quota``, ``storage`` or ``protocol``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from genie.errors import (
    ForbiddenOpError,
    FrameError,
    GenieError,
    ProtocolError,
    QuotaExceededError,
    RemoteExecutionError,
)
from genie.server import codec, preflight
from genie.server.codec import MAX_NBYTES, Descriptor, DeviceRef, check_id, is_int
from genie.server.devargs import check_device_args
from genie.server.metrics import NULL_SESSION_METRICS, SessionMetrics
from genie.server.ops import resolve_op, run_op, scrub
from genie.server.outputs import OutputMismatch, store_call_result, store_outputs
from genie.server.rng import SessionGenerators
from genie.server.store import StorageError, StorageStore, zeroed_storage
from genie.transport.base import Channel
from genie.wire.buffers import prefault, tensor_bytes
from genie.wire.frame import FrameHeader, MsgKind, discard_payload, recv_payload, send_frame
from genie.wire.messages import CMD_CALL, CMD_FETCH, CMD_FREE, CMD_OP, CMD_RESIZE, CMD_SEED, CMD_SYNC

log = logging.getLogger("genie.server.executor")

#: Most deferred errors kept between two replies; the rest are counted.
MAX_DEFERRED = 256
#: Most commands in one batch.
MAX_COMMANDS = 1 << 20
#: Seeds accepted by CMD_SEED (torch.Generator.manual_seed's range).
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)

def _hands_out_uninitialised(label: str) -> bool:
    """Ops that return memory nobody wrote (the ``empty`` family: ``empty_strided``, ``new_empty``,
    ``_empty_affine_quantized``, ``prims::empty`` ...): their results are zeroed, gaps included, so a
    session never reads bytes another session's tensors left behind. By name, so a new member of the
    family in a later torch release is covered too."""
    return "empty" in label


def _error(op: str, shapes: list[Any], kind: str, message: str, storages: Sequence[int] = ()) -> dict[str, Any]:
    return {"op": op, "shapes": shapes, "kind": kind, "message": scrub(message), "storages": list(storages)}


def _kind_of(exc: BaseException) -> str:
    if isinstance(exc, ForbiddenOpError):
        return "forbidden"
    if isinstance(exc, QuotaExceededError):
        return "quota"
    if isinstance(exc, StorageError):
        return "storage"
    if isinstance(exc, RemoteExecutionError):
        return "execution"
    if isinstance(exc, ProtocolError):
        return "protocol"
    return "execution"


def _message(exc: BaseException) -> str:
    if isinstance(exc, GenieError):
        return str(exc)
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, RuntimeError) else text


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts, in order (aten values nest nothing else)."""
    out: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return out


def _shapes(value: Any) -> list[Any]:
    return [list(v.shape) for v in tensor_leaves(value)]


def _zero_from(storage: torch.UntypedStorage, start: int) -> None:
    """Zero a storage's bytes from ``start`` on (what resize_ grew is uninitialised memory)."""
    raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    raw[start:].zero_()


class _CommandFailed(Exception):
    """A well-formed command failed; carries the deferred-error map (internal)."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["message"])
        self.record = record


class Executor:
    """Executes batches for one session over ``channel``; ``devices`` are the node's devices by index."""

    def __init__(self, channel: Channel, store: StorageStore, devices: Sequence[torch.device]) -> None:
        self.channel = channel
        self.store = store
        self.devices = list(devices)
        self.generators = SessionGenerators(self.devices)
        self.deferred: list[dict[str, Any]] = []
        self.dropped = 0
        self.ops_run = 0
        #: Most commands plus uploads one batch may carry (``max_session_inflight``): everything a client can
        #: make the server hold or queue at once without waiting for an answer.
        self.max_inflight = MAX_COMMANDS
        #: Most elements one op may iterate over or produce (``max_op_elements``; 0: unbounded).
        self.max_op_elements = preflight.DEFAULT_MAX_OP_ELEMENTS
        self.metrics: SessionMetrics = NULL_SESSION_METRICS  # metrics: the server sets each session's
        # The command being resolved: its device (where unseen storages are made) and the storages it used.
        self._device_now = self.devices[0]
        self._used: dict[int, torch.UntypedStorage] = {}

    # -- batches ------------------------------------------------------------------------------

    def run_batch(self, header: FrameHeader, body: bytes) -> None:
        """Run one BATCH frame whose header and body were read; reads its payload first."""
        # Ops run without autograd; grad mode is per thread, so switching it off here once per batch
        # replaces a no_grad() context around every op.
        torch._C._set_grad_enabled(False)
        msg = codec.decode(body)
        if not isinstance(msg, dict) or not isinstance(msg.get("uploads", []), list) \
                or not isinstance(msg.get("cmds", []), list):
            raise FrameError("a BATCH body must be a map with lists 'uploads' and 'cmds'")
        cmds = msg.get("cmds", [])
        if len(cmds) > MAX_COMMANDS:
            raise FrameError(f"a batch of {len(cmds)} commands exceeds the limit of {MAX_COMMANDS}")
        inflight = len(cmds) + len(msg.get("uploads", []))
        if inflight > self.max_inflight:
            raise QuotaExceededError(
                f"session in-flight limit exceeded: a batch of {inflight} commands and uploads, limit "
                f"{self.max_inflight} (max_session_inflight); send smaller batches")
        self._receive_uploads(header, msg.get("uploads", []))
        self.metrics.queue_depth = len(cmds)  # metrics
        for cmd in cmds:
            if not isinstance(cmd, bytes):
                raise FrameError(f"each command must be msgpack bytes, got {type(cmd).__name__}")
            self._run_command(codec.decode(cmd))
            self.metrics.queue_depth -= 1  # metrics

    def _receive_uploads(self, header: FrameHeader, uploads: list[Any]) -> None:
        specs: list[tuple[int, torch.device, int]] = []
        total = 0
        for up in uploads:
            if not isinstance(up, list) or len(up) != 3:
                raise FrameError(f"an upload must be [storage_id, device, nbytes], got {codec._preview(up)}")
            storage_id = check_id(up[0], "upload storage id")
            index = up[1].index if isinstance(up[1], DeviceRef) else up[1]
            if not is_int(index) or not 0 <= index < len(self.devices):
                raise FrameError(f"upload {storage_id} names device {index!r}; this node has {len(self.devices)}")
            nbytes = up[2]
            if not is_int(nbytes) or not 0 <= nbytes <= MAX_NBYTES:
                raise FrameError(f"upload {storage_id} has a bad byte count {codec._preview(nbytes)}")
            if storage_id == 0:
                raise FrameError("an upload cannot target storage 0 (the empty storage)")
            specs.append((storage_id, self.devices[index], nbytes))
            total += nbytes
        if total != header.payload_len:
            raise FrameError(f"uploads describe {total} payload bytes but the header says {header.payload_len}")
        if not specs:
            return
        new = [(s, n) for s, _, n in specs if s not in self.store]
        try:
            self.store.check_room(len(new), sum(n for _, n in new))
        except QuotaExceededError as exc:
            # Stay in step with the stream, then report the refusal on every storage.
            discard_payload(self.channel, total)
            for storage_id, *_ in specs:
                self.store.poison(storage_id, str(exc))
            self._defer(_error("upload", [[s[2]] for s in specs], "quota", str(exc), [s[0] for s in specs]))
            return
        # Each upload's bytes become its storage, so they land in new memory; prefaulted in one call.
        buffers = [torch.empty(nbytes, dtype=torch.uint8) for *_, nbytes in specs]
        for raw in buffers:
            prefault(raw)
        recv_payload(self.channel, header, [tensor_bytes(b) for b in buffers])
        for (storage_id, device, nbytes), raw in zip(specs, buffers, strict=True):
            self.metrics.record_bytes("in", nbytes, device)  # metrics
            try:
                self._apply_upload(storage_id, device, raw)
            except (QuotaExceededError, ProtocolError, RemoteExecutionError) as exc:
                self.store.poison(storage_id, str(exc))
                self._defer(_error("upload", [[nbytes]], _kind_of(exc), str(exc), [storage_id]))

    def _apply_upload(self, storage_id: int, device: torch.device, raw: torch.Tensor) -> None:
        try:
            existing = self.store.get(storage_id)  # StorageError for a freed id
        except RemoteExecutionError:
            existing = None  # poisoned: every byte is written again, so the storage is whole again
        if existing is None:
            self.store.put(storage_id, (raw if device.type == "cpu" else raw.to(device)).untyped_storage())
            return
        if existing.nbytes() != raw.numel():
            raise StorageError(f"upload of {raw.numel()} bytes into storage {storage_id}, which has "
                               f"{existing.nbytes()}; an upload overwrites a whole storage of the same size")
        torch.empty(0, dtype=torch.uint8, device=existing.device).set_(existing).copy_(raw)

    # -- commands -----------------------------------------------------------------------------

    def _run_command(self, cmd: Any) -> None:
        if not isinstance(cmd, list) or not cmd or not is_int(cmd[0]):
            raise FrameError(f"a command must be a list starting with a command code, got {type(cmd).__name__}")
        code = cmd[0]
        if code == CMD_OP:
            self._cmd_op(cmd)
        elif code == CMD_FREE:
            if len(cmd) != 2 or not isinstance(cmd[1], list):
                raise FrameError("FREE must be [CMD_FREE, [storage_id, ...]]")
            self.store.free(s for s in cmd[1] if is_int(s))
        elif code == CMD_FETCH:
            if len(cmd) != 4:
                raise FrameError("FETCH must be [CMD_FETCH, req, device, tensor]")
            desc = cmd[3] if isinstance(cmd[3], Descriptor) else Descriptor.parse(cmd[3], "fetched tensor")
            self._cmd_fetch(cmd[1], cmd[2], desc)
        elif code == CMD_CALL:
            self._cmd_call(cmd)
        elif code == CMD_SYNC:
            if len(cmd) != 2:
                raise FrameError("SYNC must be [CMD_SYNC, req]")
            self._cmd_sync(cmd[1])
        elif code == CMD_SEED:
            self._cmd_seed(cmd)
        elif code == CMD_RESIZE:
            self._cmd_resize(cmd)
        else:
            raise FrameError(f"unknown command code {code}")

    def _cmd_op(self, cmd: list[Any]) -> None:
        if len(cmd) != 6 or not isinstance(cmd[4], dict) or not isinstance(cmd[5], list):
            raise FrameError("OP must be [CMD_OP, device, op, args, kwargs, outs]")
        outs = [None if o is None else Descriptor.parse(o, "output descriptor") for o in cmd[5]]
        storage_ids = [o.storage_id for o in outs if o is not None and o.storage_id]
        label = _label(cmd[2])
        try:
            result, inputs = self._execute(cmd[1], cmd[2], cmd[3], cmd[4], storage_ids, outs)
            try:
                failures = store_outputs(label, result, outs, self.store, self._held(), self._known_tensor)
            except OutputMismatch as exc:
                raise _CommandFailed(_error(label, _shapes(inputs), "mismatch",
                                            f"server and client disagree on the output of {label}: {exc}",
                                            storage_ids)) from None
            except GenieError as exc:
                raise _CommandFailed(_error(label, _shapes(inputs), _kind_of(exc), str(exc), storage_ids)) from None
        except _CommandFailed as failed:
            for storage_id in storage_ids:
                self.store.poison(storage_id, f"{failed.record['op']}: {failed.record['message']}")
            self._defer(failed.record)
            return
        for failure in failures:
            self._defer(_error(label, _shapes(inputs), _kind_of(failure), _message(failure), storage_ids))

    def _cmd_call(self, cmd: list[Any]) -> None:
        if len(cmd) != 7 or not isinstance(cmd[5], dict) or not isinstance(cmd[6], list):
            raise FrameError("CALL must be [CMD_CALL, req, device, op, args, kwargs, out_storage_ids]")
        req, label = cmd[1], _label(cmd[3])
        storage_ids = [check_id(s, "CALL output storage id") for s in cmd[6]]
        error: dict[str, Any] | None = None
        encoded: Any = None
        try:
            result, _ = self._execute(cmd[2], cmd[3], cmd[4], cmd[5], storage_ids)
            try:
                encoded = store_call_result(result, storage_ids, self.store, self._held())
            except OutputMismatch as exc:
                raise _CommandFailed(_error(label, [], "mismatch", f"{label}: {exc}", storage_ids)) from None
            except GenieError as exc:
                raise _CommandFailed(_error(label, [], _kind_of(exc), str(exc), storage_ids)) from None
        except _CommandFailed as failed:
            error = failed.record
            for storage_id in storage_ids:
                self.store.poison(storage_id, f"{error['op']}: {error['message']}")
        self._reply(req, error, encoded)

    def _cmd_fetch(self, req: Any, device_index: Any, desc: Descriptor) -> None:
        try:
            self._begin(device_index)
            out = self._tensor(desc).resolve_conj().resolve_neg()
            if out.device.type != "cpu":
                out = out.cpu()
            out = out.contiguous()
        except Exception as exc:
            self._reply(req, _error("fetch", [list(desc.sizes)], _kind_of(exc), _message(exc), []), None)
            return
        self.metrics.record_bytes("out", out.nbytes, out.device)  # metrics
        self._reply(req, None, codec.describe(0, out)[1:3], [tensor_bytes(out)], keep=out)

    def _cmd_sync(self, req: Any) -> None:
        error = None
        for device in {d for d in self.devices if d.type == "cuda"}:
            try:
                torch.cuda.synchronize(device)
            except Exception as exc:  # an asynchronous kernel failure surfaces here
                error = _error("sync", [], "execution", f"{device}: {_message(exc)}")
        self._reply(req, error, None)

    def _cmd_seed(self, cmd: list[Any]) -> None:
        if len(cmd) != 4 or not is_int(cmd[2]) or not 0 <= cmd[2] < (1 << 63) or not is_int(cmd[3]) \
                or not _SEED_RANGE[0] <= cmd[3] <= _SEED_RANGE[1]:
            raise FrameError("SEED must be [CMD_SEED, device, generator_id >= 0, seed (a 64-bit integer)]")
        try:
            self._begin(cmd[1])
            self.generators.seed(cmd[1], cmd[2], cmd[3])
        except GenieError as exc:
            self._defer(_error("seed", [], _kind_of(exc), str(exc)))

    def _cmd_resize(self, cmd: list[Any]) -> None:
        if len(cmd) != 4:
            raise FrameError("RESIZE must be [CMD_RESIZE, device, storage_id, new_nbytes]")
        storage_id = check_id(cmd[2], "resized storage id")
        new = cmd[3]
        if storage_id == 0 or not is_int(new) or not 0 <= new <= MAX_NBYTES:
            raise FrameError(f"RESIZE needs a storage id above 0 and a byte count, got {cmd[2]!r}, {new!r}")
        try:
            self._begin(cmd[1])
            storage = self.store.get(storage_id)
            if storage is None:
                self.store.make(storage_id, new, self._device_now)
                return
            old = storage.nbytes()
            self.store.check_room(0, new - old)
            storage.resize_(new)
            if new > old:
                _zero_from(storage, old)
            self.store.resized(storage_id)
        except Exception as exc:
            self.store.poison(storage_id, f"resize: {_message(exc)}")
            self._defer(_error("resize", [[new]], _kind_of(exc), _message(exc), [storage_id]))

    # -- running ops --------------------------------------------------------------------------

    def _begin(self, device_index: Any) -> None:
        """Start resolving a command on ``device_index`` (ProtocolError if the node lacks it)."""
        self._device_now = self._device(device_index)
        self._used = {}

    def _execute(self, device_index: Any, name: Any, args: Any, kwargs: Any, storage_ids: list[int],
                 outs: Sequence[Descriptor | None] = ()) -> tuple[Any, Any]:
        """Resolve and run an op; raise _CommandFailed with a deferred-error record on any failure."""
        label = _label(name)
        try:
            op = resolve_op(name)
        except ForbiddenOpError as exc:
            raise _CommandFailed(_error(label, [], "forbidden", str(exc), storage_ids)) from None
        if not isinstance(args, list) or not all(isinstance(k, str) for k in kwargs):
            raise FrameError(f"{label}: args must be a list and kwargs a map with string keys")
        try:
            self._begin(device_index)
            generator = self._generator_of(device_index)
            args = codec.resolve(args, self._tensor, self._device, generator)
            kwargs = codec.resolve(kwargs, self._tensor, self._device, generator)
            check_device_args(op, label, args, kwargs)  # "meta", "cuda:7": never devices outside the node's list
            self.generators.fill_default(op, args, kwargs, device_index)
            runner = self.generators.generatorless(label, device_index)
            self._precheck_outputs(label, storage_ids, outs)
        except (GenieError, IndexError, RuntimeError) as exc:  # RuntimeError: torch refused to build a tensor
            raise _CommandFailed(_error(label, [], _kind_of(exc), _message(exc), storage_ids)) from None
        try:  # limits and argument checks on meta tensors before the kernel sees anything (genie.server.preflight)
            preflight.check(op, label, args, kwargs, max_elements=self.max_op_elements,
                            remaining_bytes=self.store.max_bytes - self.store.bytes_used if self.store.max_bytes else None)
        except GenieError as exc:
            raise _CommandFailed(_error(label, _shapes((args, kwargs)), _kind_of(exc), _message(exc),
                                        storage_ids)) from None
        inputs = (args, kwargs)  # for error messages only: _shapes() walks it when something fails
        used = self._used
        started = time.perf_counter()  # metrics
        try:
            result = runner(args, kwargs) if runner is not None else run_op(op, args, kwargs)
        except Exception as exc:
            self.metrics.record_op(label, "error", time.perf_counter() - started)  # metrics
            raise _CommandFailed(_error(label, _shapes((args, kwargs)), "execution", _message(exc),
                                        storage_ids)) from None
        finally:
            self._account_resizes(used)
        self.ops_run += 1
        self.metrics.record_op(label, "ok", time.perf_counter() - started)  # metrics
        if _hands_out_uninitialised(label):
            held = self._held()
            for t in tensor_leaves(result):
                # A fresh result is zeroed whole (a strided one has gaps); an out= result lives in a storage of
                # the session's own, whose other bytes are the session's data (grown bytes were zeroed above).
                if t.layout == torch.strided and t.untyped_storage().data_ptr() not in held:
                    _zero_from(t.untyped_storage(), 0)
        return result, inputs

    def _account_resizes(self, used: dict[int, torch.UntypedStorage]) -> None:
        """Ops like resize_ grow a storage in place: zero what it gained and count it."""
        for storage_id, storage in used.items():
            if storage_id in self.store:
                before = self.store.nbytes(storage_id)
                if storage.nbytes() != before:
                    if storage.nbytes() > before:
                        _zero_from(storage, before)
                    self.store.resized(storage_id)

    def _precheck_outputs(self, label: str, storage_ids: list[int], outs: Sequence[Descriptor | None]) -> None:
        """Refuse before running what can never fit: too many storages, or one output above the byte limit."""
        if self.store.count + len(storage_ids) > self.store.max_storages:
            self.store.check_room(len([s for s in storage_ids if s not in self.store]))
        limit = self.store.max_bytes
        for desc in outs:
            if desc is not None and limit and desc.storage_id not in self.store and desc.storage_nbytes > limit:
                raise QuotaExceededError(
                    f"output storage {desc.storage_id} of {label} would need {desc.storage_nbytes} bytes, more "
                    f"than this session's limit of {limit} bytes (max_session_bytes)")

    def _device(self, index: Any) -> torch.device:
        if not is_int(index) or not 0 <= index < len(self.devices):
            raise ProtocolError(f"device index {index!r} does not exist on this node ({len(self.devices)} devices)")
        return self.devices[index]

    def _generator_of(self, device_index: int) -> Any:
        return lambda generator_id: self.generators.get(device_index, generator_id)

    def _tensor(self, desc: Descriptor) -> torch.Tensor:
        """The described tensor; a storage never seen before is made, zero-filled, on the command's device."""
        if desc.storage_id == 0:
            desc.check(None)
            return desc.over(zeroed_storage(0, self._device_now))
        storage = self.store.get(desc.storage_id)
        if storage is None:
            desc.check(None)
            storage = self.store.make(desc.storage_id, desc.storage_nbytes, self._device_now)
        else:
            desc.check(self.store.nbytes(desc.storage_id))
        self._used[desc.storage_id] = storage
        return desc.over(storage)

    def _known_tensor(self, desc: Descriptor) -> torch.Tensor:
        """An output's described tensor over a storage the session holds (bounds checked)."""
        storage = self.store.get(desc.storage_id)
        assert storage is not None
        desc.check(self.store.nbytes(desc.storage_id))
        return desc.over(storage)

    def _held(self) -> set[int]:
        """Storage keys the last command used: its results over them are not fresh."""
        return {s.data_ptr() for s in self._used.values() if s.nbytes()}

    # -- replies ------------------------------------------------------------------------------

    def _defer(self, record: dict[str, Any]) -> None:
        log.debug("deferred error: %s", record)
        if len(self.deferred) < MAX_DEFERRED:
            self.deferred.append(record)
        else:
            self.dropped += 1

    def _reply(self, req: Any, error: dict[str, Any] | None, result: Any,
               payload: Sequence[memoryview] = (), keep: Any = None) -> None:
        deferred = self.deferred
        if self.dropped:
            deferred = [*deferred, _error("", [], "execution", f"{self.dropped} more deferred errors were dropped")]
        self.deferred, self.dropped = [], 0
        body = codec.packb([req if is_int(req) else None, error, result, deferred])
        send_frame(self.channel, MsgKind.REPLY, body, payload)
        del keep  # the payload views point into this tensor: it must outlive the send


def _label(name: Any) -> str:
    return name if isinstance(name, str) and len(name) <= 200 else "<invalid op name>"
