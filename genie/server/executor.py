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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from genie.errors import (
    ForbiddenOpError,
    FrameError,
    GenieError,
    ProtocolError,
    QuotaExceededError,
    RemoteDeviceLost,
)
from genie.server import codec, plans, preflight, transfers
from genie.server.codec import Descriptor, check_id, is_int
from genie.server.commands import COMMANDS
from genie.server.devargs import check_device_args
from genie.server.host import NodeDevice, torch_devices
from genie.server.isolation.clock import NullClock, OpClock
from genie.server.kernel import (
    SERIAL_BELOW,
    CommandFailed,
    Kernels,
    OpFacts,
    account_resizes,
    kernel_error,
    op_facts,
    zero_fresh,
)
from genie.server.metrics import NULL_SESSION_METRICS, SessionMetrics
from genie.server.ops import run_op
from genie.server.outputs import OutputMismatch, fits_outs, store_call_result, store_outputs
from genie.server.records import error as _error
from genie.server.records import kind_of as _kind_of
from genie.server.records import message as _message
from genie.server.records import shapes
from genie.server.rng import SessionGenerators
from genie.server.runner_api import runner_binding
from genie.server.store import StorageStore, zeroed_storage
from genie.transport.base import Channel
from genie.wire.frame import FrameHeader, MsgKind, encode_header, send_frame
from genie.wire.spec import BATCH_CACHED, BATCH_CMDS, BATCH_UPLOADS

log = logging.getLogger("genie.server.executor")

#: Most deferred errors kept between two replies; the rest are counted.
MAX_DEFERRED = 256
#: CUDA's sticky errors: after one, the process's CUDA context is unusable and every later op fails too.
STICKY_DEVICE_ERRORS = ("device-side assert triggered", "an illegal memory access was encountered",
                        "unspecified launch failure", "misaligned address", "an illegal instruction was encountered",
                        "uncorrectable ECC error")
#: Most commands in one batch.
MAX_COMMANDS = 1 << 20


def context_lost(records: Sequence[dict[str, Any] | None]) -> str | None:
    """Why the session's device context is lost, when one of these error records is a CUDA sticky error."""
    for record in records:
        if not isinstance(record, dict):
            continue
        message = str(record.get("message", ""))
        if "CUDA error" in message and any(sticky in message for sticky in STICKY_DEVICE_ERRORS):
            first = message.strip().splitlines()[0]
            return (f"{record.get('op') or 'an op'} failed with '{first}', which leaves the session's CUDA context "
                    "unusable (a device-side assert is often an index out of range): its tensors are gone; "
                    "reconnect with genie.shutdown() and genie.init()")
    return None


class Executor:
    """Executes batches for one session over ``channel``; ``devices`` are the node's devices by index."""

    def __init__(self, channel: Channel, store: StorageStore, devices: Sequence[NodeDevice | torch.device]) -> None:
        self.channel = channel
        self.store = store
        self.devices = torch_devices(devices)  # the node's NodeDevices (genie.server.host) as torch's
        self.generators = SessionGenerators(self.devices)
        self.deferred: list[dict[str, Any]] = []
        self.dropped = 0
        #: runs every kernel with its accounting (genie.server.kernel), and counts what ran
        self.kernels = Kernels(store)
        #: Most commands plus uploads one batch may carry (``max_session_inflight``): everything a client can
        #: make the server hold or queue at once without waiting for an answer.
        self.max_inflight = MAX_COMMANDS
        #: Most elements one op may iterate over or produce (``max_op_elements``; 0: unbounded).
        self.max_op_elements = preflight.DEFAULT_MAX_OP_ELEMENTS
        #: the native plan runner (genie._C_plans; None where it was not built): plans.native_plan's plans
        self.native = plans.new_runner(store)
        # The command being resolved: its device (where unseen storages are made) and the storages it used.
        self._device_now = self.devices[0]
        self._used: dict[int, torch.UntypedStorage] = {}
        #: uploads, fetches, the weight cache (genie.server.transfers); the server sets the node's cache
        self.transfers = transfers.SessionTransfers()
        #: validated command plans by signature (genie.server.plans)
        self.plans: dict[bytes, plans.CommandPlan] = {}
        self._checked: preflight.Plan | None = None  # the pre-flight answer of the op being run
        self._ran_functional = False  # whether it was an out= op run in its functional form
        self._functional_result = False  # what _run_fresh did last
        self._plan_bytes = 0  # key bytes the plans hold

    @property
    def clock(self) -> OpClock | NullClock:
        """The op deadline clock (isolation: a session worker's, which the native runner writes too)."""
        return self.kernels.clock

    @clock.setter
    def clock(self, clock: OpClock | NullClock) -> None:
        self.kernels.clock = clock
        if self.native is not None:
            self.native.set_clock(clock.address)

    @property
    def metrics(self) -> SessionMetrics:
        """Where the session's figures go (metrics: the server sets each session's; by default nowhere)."""
        return self.kernels.metrics

    @metrics.setter
    def metrics(self, metrics: SessionMetrics) -> None:
        self.kernels.metrics = metrics
        if self.native is not None:  # the runner counts into the same figures (genie.server.runner_api)
            self.native.bind(runner_binding(self.store, metrics if metrics is not NULL_SESSION_METRICS else None))

    @property
    def ops_run(self) -> int:
        """Ops this session ran."""
        return self.kernels.ops_run

    @property
    def plan_runs(self) -> int:
        """Ops run by a command plan (genie.server.plans), a share of :attr:`ops_run`."""
        return self.kernels.plan_runs

    @property
    def native_runs(self) -> int:
        """Ops run by the native plan runner (genie._C_plans), a share of :attr:`plan_runs`."""
        return self.kernels.native_runs

    # -- batches ------------------------------------------------------------------------------

    def run_batch(self, header: FrameHeader, body: bytes | bytearray) -> None:
        """Run one BATCH frame whose header and body were read; reads its payload first."""
        # Ops run without autograd; grad mode is per thread, so switching it off here once per batch
        # replaces a no_grad() context around every op.
        torch._C._set_grad_enabled(False)
        msg = codec.decode(body)
        if not isinstance(msg, dict) or not isinstance(msg.get(BATCH_UPLOADS, []), list) \
                or not isinstance(msg.get(BATCH_CMDS, []), list):
            raise FrameError("a BATCH body must be a map with lists 'uploads' and 'cmds'")
        cmds = msg.get(BATCH_CMDS, [])
        if len(cmds) > MAX_COMMANDS:
            raise FrameError(f"a batch of {len(cmds)} commands exceeds the limit of {MAX_COMMANDS}")
        inflight = len(cmds) + len(msg.get(BATCH_UPLOADS, [])) + len(msg.get(BATCH_CACHED, []) or ())
        if inflight > self.max_inflight:
            raise QuotaExceededError(
                f"session in-flight limit exceeded: a batch of {inflight} commands and uploads, limit "
                f"{self.max_inflight} (max_session_inflight); send smaller batches")
        transfers.receive(self, header, msg)
        self._run_commands(cmds)

    def serve_native(self, fd: int, records: bool) -> tuple[Any, ...] | None:
        """Wait for the session's next frame on socket ``fd`` (the channel's native stream, at rest) and run
        it natively where the runner can (genie._C_plans.Runner.serve): None once the frame was handled;
        else ("frame", ...), ("resume", ...) or ("io", ...), which the session takes on."""
        assert self.native is not None
        store = self.store
        try:
            got = self.native.serve(fd, records, store.bytes_used, self.max_op_elements, *self._runner_state(),
                                    min(MAX_COMMANDS, self.max_inflight))
        finally:
            store.count_native(self.native.take_grown())
        if got[0] == "done":
            self._natively_ran(got[1], got[2], None)
            self.metrics.queue_depth = 0  # metrics
            return None
        if got[0] == "batch":  # the runner stopped inside the batch: Python goes on from there
            torch._C._set_grad_enabled(False)
            self._run_commands(got[1], got[2])
            return None
        return got

    def _run_commands(self, cmds: list[Any], ran: tuple[int, int, Any] | None = None) -> None:
        """Run a batch's commands in order (``ran``: what the native runner already did from the first)."""
        self.metrics.queue_depth = len(cmds)  # metrics
        keyer, known, run_plan, native = plans.command_key, self.plans, plans.run, self.native
        index, count = 0, len(cmds)
        while index < count:
            keyed = None
            if native is not None:
                index, keyed, finished = self._run_natively(cmds, index, ran)
                ran = None
                self.metrics.queue_depth = count - index  # metrics
                if finished:  # it finished a command the runner handed back: the runner goes on after it
                    continue
                if index >= count:
                    break
            cmd = cmds[index]
            index += 1
            if type(cmd) is not bytes:
                raise FrameError(f"each command must be msgpack bytes, got {type(cmd).__name__}")
            # An op whose signature ran before runs by its plan (genie.server.plans); else the full path,
            # which makes the plan.
            head = cmd[:2]
            if keyed is None and (head == plans.OP_PREFIX or head == plans.CALL_PREFIX) and keyer is not None \
                    and len(cmd) <= plans.MAX_KEYED_BYTES:
                keyed = keyer(cmd)
            if keyed is not None:
                plan = known.get(keyed[0])
                if plan is not None and run_plan(self, plan, keyed[1], keyed[2]):
                    self.metrics.queue_depth = count - index  # metrics
                    continue
            self._run_command(codec.decode(cmd), keyed)
            self.metrics.queue_depth = count - index  # metrics

    def _run_natively(self, cmds: list[Any], index: int,
                      ran_before: tuple[int, int, Any] | None = None) -> tuple[int, plans.Keyed | None, bool]:
        """Run ``cmds[index:]`` by native plans (and FREEs) as far as the runner goes: (the index it stopped
        at, that command's key when the runner keyed it, whether a command the runner handed back was
        finished here, the index then past it). Freed storages the staging pool may take stay with Python,
        which offers them to it. ``ran_before``: the runner's result from ``index`` (serve_native ran it)."""
        assert self.native is not None
        start = index
        if ran_before is None:
            store = self.store
            try:
                ran_before = self.native.run(cmds, index, store.bytes_used, self.max_op_elements,
                                             *self._runner_state())
            finally:
                store.count_native(self.native.take_grown())
        index, ran, outcome = ran_before
        self._natively_ran(index - start, ran, outcome)
        if outcome is None:
            return index, None, False
        kind = outcome[0]
        if kind == "python":  # keyed, but no native plan: the Python plan or the full path runs it
            return index, (outcome[1], outcome[2], outcome[3]), False
        if kind == "reply":  # a CALL answered with a number (no deferred errors waited)
            send_frame(self.channel, MsgKind.REPLY, outcome[3])
        else:
            plans.finish_native(self, self.plans[outcome[1]], outcome)
        return index + 1, None, True

    def _runner_state(self) -> tuple[int, bool]:
        """The native runner's view of the session: the smallest freed storage the staging pool takes (0:
        none, so every FREE of a live storage is the runner's), and whether no deferred error waits (a CALL
        may then be answered there)."""
        pool = self.transfers.pool
        return (0 if pool.skip else pool.min_bytes), not self.deferred and not self.dropped

    def _natively_ran(self, advanced: int, ran: int, outcome: Any) -> None:
        """Count what the native runner did: ``advanced`` commands finished, ``ran`` ops run."""
        if advanced:
            self._used = {}  # what FREE does: no finished command's storages stay referenced
        if ran:
            self.kernels.natively_ran(ran, outcome is not None and outcome[0] == "failed")

    # -- commands -----------------------------------------------------------------------------

    def _run_command(self, cmd: Any, keyed: plans.Keyed | None = None) -> None:
        if not isinstance(cmd, list) or not cmd or not is_int(cmd[0]):
            raise FrameError(f"a command must be a list starting with a command code, got {type(cmd).__name__}")
        handler = COMMANDS.get(cmd[0])
        if handler is None:
            raise FrameError(f"unknown command code {cmd[0]}")
        handler(self, cmd, keyed)

    def free(self, storage_ids: Iterable[Any]) -> None:
        """Release storages (CMD_FREE); the staging pool is offered their memory."""
        self._used = {}  # the last command's storages: none may stay referenced, so the pool can reuse them
        self.store.free(storage_ids, recycle=self.transfers.pool.give)

    def run_op_command(self, cmd: list[Any], keyed: plans.Keyed | None = None) -> None:
        """``[CMD_OP, device, op, args, kwargs, outs]`` by the full path (which makes its plan when it can)."""
        if len(cmd) != 6 or not isinstance(cmd[4], dict) or not isinstance(cmd[5], list):
            raise FrameError("OP must be [CMD_OP, device, op, args, kwargs, outs]")
        # A tensor tag (decoded by the codec, layouts cached) or a plain descriptor list, checked the same way.
        outs = [o if o is None or type(o) is Descriptor else Descriptor.parse(o, "output descriptor") for o in cmd[5]]
        storage_ids = [o.storage_id for o in outs if o is not None and o.storage_id]
        label = _label(cmd[2])
        deferred = len(self.deferred) + self.dropped
        # The kwargs as sent: the full path takes an out= op's out arguments out of them (_fresh_outs).
        sent_kwargs = dict(cmd[4]) if keyed is not None else None
        try:
            result, inputs = self._execute(cmd[1], cmd[2], cmd[3], cmd[4], storage_ids, outs)
        except CommandFailed as failed:
            self.fail_outputs(failed.record, storage_ids)
            return
        self.store_outputs_of(label, result, inputs, outs, storage_ids)
        if keyed is not None and self._checked is not None and len(self.deferred) + self.dropped == deferred:
            # It ran and stored without a word: later commands of its signature may run by a plan.
            plan = plans.build(self, [*cmd[:4], sent_kwargs, cmd[5]], keyed, op_facts(cmd[2]), self._checked,
                               self._ran_functional)
            if plan is not None:
                self._remember(keyed[0], plan)

    def _remember(self, key: bytes, plan: plans.CommandPlan) -> None:
        native = self.native
        if len(self.plans) >= plans.MAX_PLANS or self._plan_bytes > plans.MAX_PLAN_BYTES:
            self.plans.clear()
            if native is not None:
                native.clear()
            self._plan_bytes = 0
        self.plans[key] = plan
        self._plan_bytes += len(key)
        if native is not None:
            native.add(key, plans.native_plan(plan))  # None: any native plan of the key is dropped

    def store_outputs_of(self, label: str, result: Any, inputs: Any, outs: list[Descriptor | None],
                         storage_ids: list[int]) -> None:
        """Keep an op's results by the output rule; a mismatch fails the command (its outputs poisoned), a
        store failure of one output (quota) is deferred."""
        try:
            failures = store_outputs(label, result, outs, self.store, self._held(), self._known_tensor)
        except OutputMismatch as exc:
            self.fail_outputs(_error(label, shapes(inputs), "mismatch",
                                     f"server and client disagree on the output of {label}: {exc}", storage_ids),
                              storage_ids)
            return
        except GenieError as exc:
            self.fail_outputs(_error(label, shapes(inputs), _kind_of(exc), str(exc), storage_ids), storage_ids)
            return
        for failure in failures:
            self._defer(_error(label, shapes(inputs), _kind_of(failure), _message(failure), storage_ids))

    def fail_outputs(self, record: dict[str, Any], storage_ids: Sequence[int]) -> None:
        """A command that was to fill ``storage_ids`` failed: poison them with its error and defer the record."""
        for storage_id in storage_ids:
            self.store.poison(storage_id, f"{record['op']}: {record['message']}")
        self._defer(record)

    def run_call_command(self, cmd: list[Any], keyed: plans.Keyed | None = None) -> None:
        """``[CMD_CALL, req, device, op, args, kwargs, out_storage_ids]`` by the full path (and its plan)."""
        if len(cmd) != 7 or not isinstance(cmd[5], dict) or not isinstance(cmd[6], list):
            raise FrameError("CALL must be [CMD_CALL, req, device, op, args, kwargs, out_storage_ids]")
        req, label = cmd[1], _label(cmd[3])
        storage_ids = [check_id(s, "CALL output storage id") for s in cmd[6]]
        sent_kwargs = dict(cmd[5]) if keyed is not None else None
        try:
            result, _ = self._execute(cmd[2], cmd[3], cmd[4], cmd[5], storage_ids)
        except CommandFailed as failed:
            self.fail_call(req, failed.record, storage_ids)
            return
        if self.finish_call(label, req, result, storage_ids) and keyed is not None and self._checked is not None:
            # It ran and answered without a word: later calls of its signature may run by a plan.
            plan = plans.build_call(self, [*cmd[:5], sent_kwargs, cmd[6]], keyed, op_facts(cmd[3]), self._checked)
            if plan is not None:
                self._remember(keyed[0], plan)

    def finish_call(self, label: str, req: Any, result: Any, storage_ids: list[int]) -> bool:
        """Keep a CALL's result tensors under ``storage_ids`` and answer ``req``; False when that failed (the
        error answered, the storages poisoned)."""
        try:
            encoded = store_call_result(result, storage_ids, self.store, self._held())
        except OutputMismatch as exc:
            self.fail_call(req, _error(label, [], "mismatch", f"{label}: {exc}", storage_ids), storage_ids)
            return False
        except GenieError as exc:
            self.fail_call(req, _error(label, [], _kind_of(exc), str(exc), storage_ids), storage_ids)
            return False
        self._reply(req, None, encoded)
        return True

    def fail_call(self, req: Any, error: dict[str, Any], storage_ids: list[int]) -> None:
        """A CALL failed: poison its output storages with ``error`` and answer ``req`` with it."""
        for storage_id in storage_ids:
            self.store.poison(storage_id, f"{error['op']}: {error['message']}")
        self._reply(req, error, None)

    # -- running ops --------------------------------------------------------------------------

    def _begin(self, device_index: Any) -> None:
        """Start resolving a command on ``device_index`` (ProtocolError if the node lacks it)."""
        self._device_now = self._device(device_index)
        self._used = {}

    def _execute(self, device_index: Any, name: Any, args: Any, kwargs: Any, storage_ids: list[int],
                 outs: Sequence[Descriptor | None] = ()) -> tuple[Any, Any]:
        """Resolve and run an op; raise CommandFailed with a deferred-error record on any failure."""
        label = _label(name)
        self._checked = None
        try:
            plan = op_facts(name)
        except ForbiddenOpError as exc:
            raise CommandFailed(_error(label, [], "forbidden", str(exc), storage_ids)) from None
        op = plan.op
        if type(args) is not list or (kwargs and not all(isinstance(k, str) for k in kwargs)):
            raise FrameError(f"{label}: args must be a list and kwargs a map with string keys")
        try:
            self._begin(device_index)
            generator = self._generator_of(device_index)
            fresh = self._fresh_outs(plan, kwargs, outs)
            args = codec.resolve(args, self._tensor, self._device, generator)
            if kwargs:
                kwargs = codec.resolve(kwargs, self._tensor, self._device, generator)
            if plan.devargs:  # "meta", "cuda:7": never devices outside the node's list
                check_device_args(op, label, args, kwargs)
            if plan.generator_arg:
                self.generators.fill_default(op, args, kwargs, device_index)
            runner = self.generators.generatorless(label, device_index) if plan.generatorless else None
            self._precheck_outputs(label, storage_ids, outs)
        except (GenieError, IndexError, RuntimeError) as exc:  # RuntimeError: torch refused to build a tensor
            raise CommandFailed(_error(label, [], _kind_of(exc), _message(exc), storage_ids)) from None
        # Limits and argument checks on meta tensors before the kernel sees anything (genie.server.preflight),
        # under the op deadline too: a meta run goes through decompositions, and one can loop or allocate
        # without end (combinations with r = 2**31 built a list of 2**31 tensors; found by the fuzzer).
        self.clock.begin(f"{label} (pre-flight)")  # isolation
        try:
            planned = plan.functional if fresh is not None and plan.functional is not None else op
            checked = preflight.check(
                planned, label, args, kwargs, max_elements=self.max_op_elements,
                remaining_bytes=self.store.max_bytes - self.store.bytes_used if self.store.max_bytes else None)
        except GenieError as exc:
            raise CommandFailed(_error(label, shapes((args, kwargs)), _kind_of(exc), _message(exc),
                                        storage_ids)) from None
        finally:
            self.clock.end()  # isolation
        inputs = (args, kwargs)  # for error messages only: shapes() walks it when something fails
        used = self._used
        resizes = used if plan.writes or runner is not None or fresh is not None else None
        serial = self._device_now.type == "cpu" and checked.max_input < SERIAL_BELOW  # kernel.serial_size's rule
        try:
            if fresh is not None:
                result = self.kernels.run(label, self._run_fresh, (plan, args, kwargs, fresh, outs, generator),
                                          serial=serial, used=resizes)
            elif runner is not None:
                result = self.kernels.run(label, runner, (args, kwargs), serial=serial, used=resizes)
            else:
                result = self.kernels.run(label, run_op, (op, args, kwargs), serial=serial, used=resizes)
        except Exception as exc:  # noqa: BLE001 - the kernel's failure is the command's deferred error
            raise CommandFailed(kernel_error(label, args, kwargs, exc, storage_ids)) from None
        # For a plan (genie.server.plans): the pre-flight answer, and whether an out= op ran its functional form.
        self._checked = checked
        self._ran_functional = fresh is not None and self._functional_result
        if plan.uninitialised:
            zero_fresh(result, self._held())
        return result, inputs

    def _fresh_outs(self, plan: OpFacts, kwargs: dict[str, Any], outs: Sequence[Descriptor | None]) -> list[Any] | None:
        """For an out= op whose every out argument is a storage this session has not made yet: the out
        arguments, taken out of ``kwargs`` (then run by :meth:`_run_fresh`); else None.

        Structured ops reach the client's fallback as their ``.out`` form with a fresh ``[]`` output
        (``mse_loss``); running that form here would build the output at the wrong size and make
        torch warn on the server's stderr, once per op, that it resized it.
        """
        if plan.functional is None or len(outs) != len(plan.out_names):
            return None
        for desc in outs:
            if desc is None or desc.storage_id in self.store:
                return None
            self.store.check_usable(desc.storage_id)  # a freed or poisoned id fails as it would in resolve
        values = [kwargs.get(n) for n in plan.out_names]
        if not all(type(v) is Descriptor for v in values):
            return None
        for n in plan.out_names:
            del kwargs[n]
        return values

    def _run_fresh(self, plan: OpFacts, args: list[Any], kwargs: dict[str, Any], fresh: list[Any],
                   outs: Sequence[Descriptor | None], generator: Any) -> Any:
        """Run the functional form; where its results differ in dtype or size from the out arguments
        (out= may cast), run the out= form after all, as the client asked."""
        assert plan.functional is not None
        result = run_op(plan.functional, args, kwargs)
        self._functional_result = fits_outs(result, outs)
        if self._functional_result:
            return result
        for n, value in zip(plan.out_names, fresh, strict=True):
            kwargs[n] = codec.resolve(value, self._tensor, self._device, generator)
        return run_op(plan.op, args, kwargs)

    def run_out_form(self, op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any],
                     fresh: list[tuple[str, Descriptor]], device_index: int) -> Any:
        """What :meth:`_run_fresh` does when the functional result does not fit the out arguments: run the out=
        form after all, its out arguments resolved (made) now."""
        for name, desc in fresh:
            kwargs[name] = codec.resolve(desc, self._tensor, self._device, self._generator_of(device_index))
        return run_op(op, args, kwargs)

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
        body, deferred = self._reply_body(req, error, result)
        send_frame(self.channel, MsgKind.REPLY, body, payload)
        del keep  # the payload views point into this tensor: it must outlive the send
        self._after_reply(error, deferred)

    def _reply_body(self, req: Any, error: dict[str, Any] | None, result: Any) -> tuple[bytes, list[Any]]:
        deferred = self.deferred
        if self.dropped:
            deferred = [*deferred, _error("", [], "execution", f"{self.dropped} more deferred errors were dropped")]
        self.deferred, self.dropped = [], 0
        return codec.packb([req if is_int(req) else None, error, result, deferred]), deferred

    def _after_reply(self, error: dict[str, Any] | None, deferred: list[Any]) -> None:
        if error is not None or deferred:
            lost = context_lost([error, *deferred])
            if lost is not None:  # the client has the op's error; the session cannot go on
                raise RemoteDeviceLost(lost)


    # -- the interface of command handlers (genie.server.commands: graphs, transfers, controls, plans) -------

    def begin(self, device_index: Any) -> torch.device:
        """Start a command on ``device_index`` (ProtocolError if the node lacks it); returns the device."""
        self._begin(device_index)
        return self._device_now

    def device(self, index: Any) -> torch.device:
        """The node's device ``index`` (ProtocolError if it lacks it)."""
        return self._device(index)

    def resolve_values(self, values: Any, device_index: int) -> Any:
        """``values`` with descriptors, devices and generators replaced, as an op's arguments are (bounds checked;
        every storage used is recorded for :meth:`used_storages`)."""
        return codec.resolve(values, self._tensor, self._device, self._generator_of(device_index))

    def precheck_outputs(self, label: str, storage_ids: list[int], outs: Sequence[Descriptor | None]) -> None:
        """QuotaExceededError before running what can never fit (see :meth:`_precheck_outputs`)."""
        self._precheck_outputs(label, storage_ids, outs)

    def set_current(self, device: torch.device, used: dict[int, torch.UntypedStorage]) -> None:
        """The command being run (by a plan) runs on ``device`` and uses the storages ``used``."""
        self._device_now = device
        self._used = used

    def used_storages(self) -> dict[int, torch.UntypedStorage]:
        """The storages the command being run resolved, by id."""
        return self._used

    def held_keys(self) -> set[int]:
        """Storage keys of the storages the current command used (its results over them are not fresh)."""
        return self._held()

    def account_resizes(self, used: dict[int, torch.UntypedStorage]) -> None:
        """Zero and count what ops that resize storages in place made them gain."""
        account_resizes(self.store, used)

    def store_results(self, label: str, results: Any, outs: list[Descriptor | None], held: set[int]) -> list[Exception]:
        """Store a command's results by the output rule (:func:`genie.server.outputs.store_outputs`)."""
        return store_outputs(label, results, outs, self.store, held, self._known_tensor)

    def reply(self, req: Any, error: dict[str, Any] | None, result: Any, payload: Sequence[memoryview] = (),
              keep: Any = None) -> None:
        """Answer request ``req`` (with the deferred errors); ``payload``: raw bytes after the body, views into
        ``keep``, which must outlive the send."""
        self._reply(req, error, result, payload, keep)

    def reply_in_parts(self, req: Any, result: Any, payload_len: int,
                       write: Callable[[Callable[[memoryview], None]], None]) -> None:
        """Answer request ``req`` with ``payload_len`` bytes of payload that ``write`` sends in parts, in order (it is
        handed the function that sends one): a chunked download (genie.server.staging.stream_out), never in
        memory whole. The header and body go first, so a failure after them ends the session (ProtocolError
        when ``write`` sent another byte count). A resumable session's link keeps no copy of such a reply (as
        of any reply over genie.server.resume.MAX_RECORDED_BYTES): losing it in a drop ends the session."""
        body, deferred = self._reply_body(req, None, result)
        # ResumeLink.sendv_part: sent without a record for a resend; a plain channel's sendv otherwise.
        send = getattr(self.channel, "sendv_part", self.channel.sendv)
        send([encode_header(MsgKind.REPLY, len(body), payload_len), body])
        sent = 0

        def part(view: memoryview) -> None:
            nonlocal sent
            if sent + view.nbytes > payload_len:
                raise ProtocolError(f"a reply in parts sent more than the {payload_len} payload bytes it announced")
            send([view])
            sent += view.nbytes

        write(part)
        if sent != payload_len:
            raise ProtocolError(f"a reply in parts sent {sent} of the {payload_len} payload bytes it announced")
        self._after_reply(None, deferred)

    def tensor(self, desc: Descriptor) -> torch.Tensor:
        """The described tensor over the session's storage (bounds checked; a storage never seen before is made,
        zero-filled, on the command's device)."""
        return self._tensor(desc)

    def defer(self, record: dict[str, Any]) -> None:
        """Keep an error record for the next reply."""
        self._defer(record)


def _label(name: Any) -> str:
    return name if isinstance(name, str) and len(name) <= 200 else "<invalid op name>"
