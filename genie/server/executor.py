"""Runs one session's batches: uploads, ops, calls, fetches, frees and syncs.

The executor belongs to one session and runs on that session's thread, so the
ops of a session run in the order the client sent them. It never trusts the
client's metadata: every op output is checked against what the client computed
with meta tensors, and any disagreement is reported, never silently stored.

Errors are of two sorts. A frame or command that breaks the wire rules raises
:class:`~genie.errors.FrameError` and the session closes the connection. A
command that is well formed but fails (an op raises, a handle is unknown or
poisoned, an op is forbidden, a quota is hit) becomes a *deferred error*: a map
``{"op", "shapes", "kind", "message", "handles"}`` carried by the next reply,
with the command's output handles poisoned so later uses name the root cause.
``kind`` is one of ``execution``, ``mismatch``, ``forbidden``, ``quota``,
``handle`` or ``protocol``.
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
from genie.server import codec
from genie.server.codec import OutSpec, check_dtype, check_handle, check_ints, is_int, numel_of
from genie.server.metrics import NULL_SESSION_METRICS, SessionMetrics
from genie.server.ops import resolve_op
from genie.server.store import TensorStore, UnknownHandleError
from genie.transport.base import Channel
from genie.wire.buffers import tensor_bytes
from genie.wire.frame import FrameHeader, MsgKind, discard_payload, recv_payload, send_frame
from genie.wire.messages import CMD_CALL, CMD_FETCH, CMD_FREE, CMD_OP, CMD_SYNC

log = logging.getLogger("genie.server.executor")

#: Most deferred errors kept between two replies; the rest are counted.
MAX_DEFERRED = 256
#: Most commands in one batch.
MAX_COMMANDS = 1 << 20

#: Ops that hand out uninitialised memory: their outputs are zeroed so a session
#: never reads bytes another session's tensors left behind.
_UNINITIALISED = frozenset({
    "aten::empty.memory_format", "aten::empty.names", "aten::empty_like", "aten::empty_strided",
    "aten::empty_permuted", "aten::new_empty", "aten::new_empty_strided", "aten::empty_quantized",
    "prims::empty", "prims::empty_strided", "prims::empty_permuted",
})
_RESIZING = frozenset({"aten::resize_", "aten::resize_as_", "aten::_resize_output_", "aten::set_.source_Tensor",
                       "aten::set_.source_Tensor_storage_offset", "aten::set_data", "prims::resize"})


def _error(op: str, shapes: list[Any], kind: str, message: str, handles: Sequence[int] = ()) -> dict[str, Any]:
    return {"op": op, "shapes": shapes, "kind": kind, "message": message, "handles": list(handles)}


def _kind_of(exc: BaseException) -> str:
    if isinstance(exc, ForbiddenOpError):
        return "forbidden"
    if isinstance(exc, QuotaExceededError):
        return "quota"
    if isinstance(exc, UnknownHandleError):
        return "handle"
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


def _shapes(value: Any) -> list[Any]:
    return [list(v.shape) for v in tensor_leaves(value)]


def _zero_grown_storages(tensors: list[torch.Tensor], sizes_before: dict[int, int]) -> None:
    """Zero the bytes a storage gained in place (resize_ hands out uninitialised memory)."""
    for t in tensors:
        old = sizes_before.get(id(t), 0)
        storage = t.untyped_storage()
        if t.layout == torch.strided and storage.nbytes() > old:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            raw[old:].zero_()


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


class _CommandFailed(Exception):
    """A well-formed command failed; carries the deferred-error map (internal)."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["message"])
        self.record = record


class Executor:
    """Executes batches for one session over ``channel``; ``devices`` are the node's devices by index."""

    def __init__(self, channel: Channel, store: TensorStore, devices: Sequence[torch.device]) -> None:
        self.channel = channel
        self.store = store
        self.devices = list(devices)
        self.deferred: list[dict[str, Any]] = []
        self.dropped = 0
        self.ops_run = 0
        #: Most commands plus uploads one batch may carry (``max_session_inflight``): everything a client can
        #: make the server hold or queue at once without waiting for an answer.
        self.max_inflight = MAX_COMMANDS
        self.metrics: SessionMetrics = NULL_SESSION_METRICS  # metrics: the server sets each session's

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
        specs = []
        total = 0
        for up in uploads:
            if not isinstance(up, list) or len(up) != 5:
                raise FrameError(f"an upload must be [handle, device, dtype, shape, nbytes], got {up!r}")
            handle = check_handle(up[0], "upload handle")
            index = up[1].index if isinstance(up[1], codec.DeviceRef) else up[1]
            if not is_int(index) or not 0 <= index < len(self.devices):
                raise FrameError(f"upload {handle} names device {index!r}; this node has {len(self.devices)}")
            dtype = check_dtype(up[2], "upload dtype")
            shape = check_ints(up[3], "upload shape")
            nbytes = up[4]
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not is_int(nbytes) or nbytes != numel_of(shape) * itemsize:
                raise FrameError(f"upload {handle} of {dtype} {shape} must have {numel_of(shape) * itemsize} bytes, "
                                 f"got {nbytes!r}")
            specs.append((handle, self.devices[index], dtype, shape, nbytes))
            total += nbytes
        if total != header.payload_len:
            raise FrameError(f"uploads describe {total} payload bytes but the header says {header.payload_len}")
        if not specs:
            return
        try:
            self.store.check_room(len(specs), total)
        except QuotaExceededError as exc:
            # Stay in step with the stream, then report the refusal on every handle.
            discard_payload(self.channel, total)
            for handle, *_ in specs:
                self.store.poison(handle, str(exc))
            self._defer(_error("upload", [s[3] for s in specs], "quota", str(exc), [s[0] for s in specs]))
            return
        buffers = [torch.empty(nbytes, dtype=torch.uint8) for *_, nbytes in specs]
        recv_payload(self.channel, header, [tensor_bytes(b) for b in buffers])
        for (handle, device, dtype, shape, _), raw in zip(specs, buffers, strict=True):
            tensor = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
            if device.type != "cpu":
                tensor = tensor.to(device)
            self.metrics.record_bytes("in", raw.numel(), device)  # metrics
            try:
                self.store.put(handle, tensor)
            except (QuotaExceededError, ProtocolError) as exc:
                self.store.poison(handle, str(exc))
                self._defer(_error("upload", [shape], _kind_of(exc), str(exc), [handle]))

    # -- commands -----------------------------------------------------------------------------

    def _run_command(self, cmd: Any) -> None:
        if not isinstance(cmd, list) or not cmd or not is_int(cmd[0]):
            raise FrameError(f"a command must be a list starting with a command code, got {type(cmd).__name__}")
        code = cmd[0]
        if code == CMD_OP:
            self._cmd_op(cmd)
        elif code == CMD_FREE:
            if len(cmd) != 2 or not isinstance(cmd[1], list):
                raise FrameError("FREE must be [CMD_FREE, [handle, ...]]")
            self.store.free(h for h in cmd[1] if is_int(h))
        elif code == CMD_FETCH:
            if len(cmd) != 3:
                raise FrameError("FETCH must be [CMD_FETCH, req, handle]")
            self._cmd_fetch(cmd[1], check_handle(cmd[2], "fetched handle"))
        elif code == CMD_CALL:
            self._cmd_call(cmd)
        elif code == CMD_SYNC:
            if len(cmd) != 2:
                raise FrameError("SYNC must be [CMD_SYNC, req]")
            self._cmd_sync(cmd[1])
        else:
            raise FrameError(f"unknown command code {code}")

    def _cmd_op(self, cmd: list[Any]) -> None:
        if len(cmd) != 5 or not isinstance(cmd[3], dict) or not isinstance(cmd[4], list):
            raise FrameError("OP must be [CMD_OP, op, args, kwargs, outs]")
        name, args, kwargs = cmd[1], cmd[2], cmd[3]
        outs = [OutSpec.parse(o) for o in cmd[4]]
        handles = [o.handle for o in outs]
        try:
            result, inputs = self._execute(name, args, kwargs, handles, outs)
            self._store_checked(str(name), result, outs, inputs)
        except _CommandFailed as failed:
            for handle in handles:
                self.store.poison(handle, f"{failed.record['op']}: {failed.record['message']}")
            self._defer(failed.record)

    def _cmd_call(self, cmd: list[Any]) -> None:
        if len(cmd) != 6 or not isinstance(cmd[4], dict) or not isinstance(cmd[5], list):
            raise FrameError("CALL must be [CMD_CALL, req, op, args, kwargs, out_handles]")
        req, name, args, kwargs = cmd[1], cmd[2], cmd[3], cmd[4]
        handles = [check_handle(h, "CALL output handle") for h in cmd[5]]
        error: dict[str, Any] | None = None
        encoded: Any = None
        try:
            result, _ = self._execute(name, args, kwargs, handles)
            encoded = self._store_call_result(str(name), result, handles)
        except _CommandFailed as failed:
            error = failed.record
            for handle in handles:
                self.store.poison(handle, f"{error['op']}: {error['message']}")
        self._reply(req, error, encoded)

    def _cmd_fetch(self, req: Any, handle: int) -> None:
        try:
            tensor = self.store.get(handle)
            out = tensor.resolve_conj().resolve_neg()
            if out.device.type != "cpu":
                out = out.cpu()
            out = out.contiguous()
            if out.layout != torch.strided:
                raise ProtocolError(f"handle {handle} holds a {out.layout} tensor, which cannot be fetched")
        except Exception as exc:
            self._reply(req, _error("fetch", [], _kind_of(exc), _message(exc), [handle]), None)
            return
        self.metrics.record_bytes("out", out.nbytes, tensor.device)  # metrics
        self._reply(req, None, codec.describe(handle, out)[1:3], [tensor_bytes(out)], keep=out)

    def _cmd_sync(self, req: Any) -> None:
        error = None
        for device in {d for d in self.devices if d.type == "cuda"}:
            try:
                torch.cuda.synchronize(device)
            except Exception as exc:  # an asynchronous kernel failure surfaces here
                error = _error("sync", [], "execution", f"{device}: {_message(exc)}")
        self._reply(req, error, None)

    # -- running ops --------------------------------------------------------------------------

    def _execute(self, name: Any, args: Any, kwargs: dict[str, Any], outs: list[int],
                 specs: Sequence[OutSpec] = ()) -> tuple[Any, list[Any]]:
        """Resolve and run an op; raise _CommandFailed with a deferred-error record on any failure."""
        label = name if isinstance(name, str) and len(name) <= 200 else "<invalid op name>"
        try:
            op = resolve_op(name)
        except ForbiddenOpError as exc:
            raise _CommandFailed(_error(label, [], "forbidden", str(exc), outs)) from None
        if not isinstance(args, list) or not all(isinstance(k, str) for k in kwargs):
            raise FrameError(f"{label}: args must be a list and kwargs a map with string keys")
        try:
            args = codec.resolve(args, self.store.get, self._device)
            kwargs = codec.resolve(kwargs, self.store.get, self._device)
        except (GenieError, IndexError) as exc:
            raise _CommandFailed(_error(label, [], _kind_of(exc), _message(exc), outs)) from None
        inputs = tensor_leaves((args, kwargs))
        self._precheck_outputs(label, outs, specs)
        sizes_before = {id(t): t.untyped_storage().nbytes() for t in inputs} if label in _RESIZING else {}
        started = time.perf_counter()  # metrics
        try:
            result = op(*args, **kwargs)  # grad mode is off on this thread (run_batch)
        except Exception as exc:
            self.metrics.record_op(label, "error", time.perf_counter() - started)  # metrics
            raise _CommandFailed(_error(label, _shapes((args, kwargs)), "execution", _message(exc), outs)) from None
        self.ops_run += 1
        self.metrics.record_op(label, "ok", time.perf_counter() - started)  # metrics
        if label in _UNINITIALISED:
            for t in tensor_leaves(result):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    t.zero_()
        if label in _RESIZING:
            _zero_grown_storages(inputs, sizes_before)
            self.store.recount()
        return result, inputs

    def _precheck_outputs(self, label: str, outs: list[int], specs: Sequence[OutSpec]) -> None:
        """Refuse before running what can never fit: too many handles, or one output above the byte limit."""
        try:
            self.store.check_room(len([h for h in outs if h not in self.store]))
            limit = self.store.max_bytes
            for spec in specs:
                nbytes = spec.numel() * spec.dtype.itemsize
                if limit and nbytes > limit:
                    raise QuotaExceededError(
                        f"output {spec.handle} of {label} would need {nbytes} bytes, more than this session's "
                        f"limit of {limit} bytes (max_session_bytes)")
        except QuotaExceededError as exc:
            raise _CommandFailed(_error(label, [], "quota", str(exc), outs)) from None

    def _device(self, index: int) -> torch.device:
        if not 0 <= index < len(self.devices):
            raise ProtocolError(f"device index {index} does not exist on this node ({len(self.devices)} devices)")
        return self.devices[index]

    def _store_checked(self, op: str, result: Any, outs: list[OutSpec], inputs: list[torch.Tensor]) -> None:
        """Check each tensor output against the client's spec and store it, or fail the command."""
        tensors = tensor_leaves(result)
        if len(tensors) != len(outs):
            raise _CommandFailed(_error(
                op, _shapes(inputs), "mismatch",
                f"server and client disagree on the output of {op}: it returned {len(tensors)} tensors, "
                f"the client expected {len(outs)}", [o.handle for o in outs]))
        input_storages = {t.untyped_storage()._cdata for t in inputs if t.layout == torch.strided}
        checked = []
        for i, (t, spec) in enumerate(zip(tensors, outs, strict=True)):
            checked.append(self._conform(op, i, t, spec, input_storages, inputs, [o.handle for o in outs]))
        failures = []
        for spec, t in zip(outs, checked, strict=True):
            if spec.handle in self.store and self.store.get(spec.handle) is t:
                continue  # an in-place op (copy_, add_, out=) returned the tensor it wrote into
            try:
                self.store.put(spec.handle, t)
            except (QuotaExceededError, ProtocolError) as exc:
                self.store.poison(spec.handle, f"{op}: {exc}")
                failures.append(_error(op, _shapes(inputs), _kind_of(exc), str(exc), [spec.handle]))
        for record in failures:
            self._defer(record)

    def _conform(self, op: str, i: int, t: torch.Tensor, spec: OutSpec, input_storages: set[int],
                 inputs: list[torch.Tensor], handles: list[int]) -> torch.Tensor:
        def disagree(what: str) -> _CommandFailed:
            return _CommandFailed(_error(
                op, _shapes(inputs), "mismatch",
                f"server and client disagree on the output of {op}: output {i} (handle {spec.handle}) {what}",
                handles))

        if t.layout != torch.strided:
            raise disagree(f"is a {t.layout} tensor; genie servers store strided tensors only")
        if t.dtype != spec.dtype:
            raise disagree(f"has dtype {t.dtype} here, the client expected {spec.dtype}")
        if list(t.shape) != spec.shape:
            raise disagree(f"has shape {list(t.shape)} here, the client expected {spec.shape}")
        if list(t.stride()) == spec.stride and t.storage_offset() == spec.offset:
            return t
        if t.untyped_storage()._cdata in input_storages:
            raise disagree(
                f"is a view with stride {list(t.stride())} and offset {t.storage_offset()} here, the client expected "
                f"stride {spec.stride} and offset {spec.offset}; a view cannot be re-laid out without breaking aliasing")
        # A fresh tensor laid out differently: copy it into the layout the client computed.
        span = 1 + sum((s - 1) * st for s, st in zip(spec.shape, spec.stride, strict=True)) if spec.numel() else 0
        base = torch.empty(spec.offset + span, dtype=t.dtype, device=t.device)
        out = base.as_strided(spec.shape, spec.stride, spec.offset)
        out.copy_(t)
        log.debug("%s output %d re-laid out from stride %s to %s", op, i, list(t.stride()), spec.stride)
        return out

    def _store_call_result(self, op: str, result: Any, handles: list[int]) -> Any:
        tensors = tensor_leaves(result)
        if len(tensors) > len(handles):
            raise _CommandFailed(_error(
                op, [], "mismatch", f"{op} returned {len(tensors)} tensors but the CALL gave {len(handles)} handles",
                handles))
        pending = iter(handles)

        def store(t: torch.Tensor) -> list[Any]:
            handle = next(pending)
            if t.layout != torch.strided:
                raise ProtocolError(f"{op} returned a {t.layout} tensor; genie servers store strided tensors only")
            self.store.put(handle, t)
            return codec.describe(handle, t)

        try:
            return codec.encode_result(result, store)
        except (ProtocolError, QuotaExceededError) as exc:
            raise _CommandFailed(_error(op, [], _kind_of(exc), str(exc), handles)) from None

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
