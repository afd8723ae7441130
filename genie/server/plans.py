"""Validated per-signature command plans: a repeated op costs little more than its kernel.

A client sends the same ops over and over (a training step is a few hundred commands, repeated), and
each differs from the last time only in its storage ids: a fresh output per op. The full path of a
``CMD_OP`` (msgpack decode, op resolution and the allow-list, descriptor checks, the pre-flight meta
run, the output rule) is the same work every time. So:

- :func:`genie._C_keys.command_key` (genie/csrc/server/keys_module.cpp) walks a command's msgpack bytes,
  bounds-checked, and returns its *key*: the bytes with every tensor tag's storage id and every float
  taken out, plus which ids alias which (and which are storage 0); the ids in order; the floats in
  order. An optimizer's step sizes change every step: with the floats out of the key its ops keep
  their plans. Where a float's value may change the outputs' metadata
  (:func:`genie.wire.floats.floats_decide_metadata`: ranges, scale factors, ops that return numbers),
  the plan holds the floats it was checked with and runs only for the same values; elsewhere it fills
  each command's floats in (they never change what the pre-flight checked: dtypes, shapes, strides).
- The first command with a key runs the full path. When it succeeds, and its op is one a plan covers
  (:func:`build`), a :class:`CommandPlan` is kept under the key: the op's bound kernel, the argument
  templates with a slot per tensor, the checked layouts, the pre-flight answer.
- A later command with the same key is the same op on the same argument structure, layouts and
  scalars (the key says so byte for byte), so only what depends on the storages runs again
  (:func:`run`): each input storage must be live (not unknown, freed or poisoned) and hold exactly the
  ``storage_nbytes`` its descriptor says (bounds were checked for that size), the storage count and
  byte quotas must leave room, the op's validator (when it has one and it may read data: not one of
  :data:`~genie.server.validators.KEY_FIXED`, which read only what the key fixes) must pass. The
  tensors are built, the kernel called, and each result adopted when it is fresh, dense and laid out as
  the descriptor says (or already is the described storage, for in-place ops); anything else goes
  through the full output rule (:func:`genie.server.outputs.store_outputs`).

A plan of the common shape (tensors as direct arguments, no validator) also gets a
:class:`genie._C_plans.NativePlan` (:func:`native_plan`): the session's :class:`genie._C_plans.Runner`
then walks a batch's commands in C++ (keying, the same per-storage checks, the kernel through the
dispatcher with the GIL released, the op clock, the common output adoption) and hands back to Python
only what it cannot finish there (:func:`finish_native`): an error, a result the full output rule must
judge, a storage resized in place, a CALL's answer.

Any check that does not pass before the kernel runs sends the command down the full path, which
raises the same error with the same record as it always did: the plan path changes no error. A plan is
made only from a command the full path accepted; nothing in a plan comes from the network that the
full path did not check. Plans are per session (its limits are part of what was checked).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from genie.server import validators
from genie.server.codec import Descriptor, DeviceRef
from genie.server.kernel import SERIAL_BELOW, kernel_error, serial_size, use_serial  # noqa: F401 - re-exported
from genie.server.ops import run_op
from genie.server.outputs import adopt_described, fits_outs
from genie.server.records import error as _error
from genie.server.records import kind_of, shapes
from genie.server.records import message as _message
from genie.server.runner_api import native_spec, runner_binding
from genie.server.store import MAX_REMEMBERED_FREES, StorageStore, zeroed_storage
from genie.wire.floats import floats_decide_metadata
from genie.wire.messages import CMD_OP

if TYPE_CHECKING:
    from genie.server.executor import Executor
    from genie.server.kernel import OpFacts
    from genie.server.preflight import Plan

#: A keyed command: (key, storage ids, floats), what :func:`genie._C_keys.command_key` returns.
Keyed = tuple[bytes, tuple[int, ...], tuple[float, ...]]
command_key: Callable[[bytes], Keyed | None] | None
try:  # built with genie._C by setup.py; without it every command takes the full path
    from genie._C_keys import command_key
except ImportError:  # pragma: no cover - an install that did not build the extension
    command_key = None
NativePlan: Any
Runner: Any
try:  # the native plan runner (genie/csrc/server/runner.cpp); without it plans run in Python
    from genie._C_plans import NativePlan, Runner
except ImportError:  # pragma: no cover - an install that did not build the extension
    NativePlan = Runner = None

log = logging.getLogger("genie.server.plans")

#: Most plans one session keeps (emptied when full: a client sending endless new signatures only loses speed).
MAX_PLANS = 4096
#: Longest command keyed (bigger ones are rare and their decode dominates anyway).
MAX_KEYED_BYTES = 16 << 10
#: Most key bytes one session's plans may hold (then emptied): bounds their memory whatever the client sends.
MAX_PLAN_BYTES = 8 << 20
#: What a CMD_OP's msgpack starts with: a fixarray of 6, then CMD_OP (1) as a positive fixint.
OP_PREFIX = b"\x96\x01"
#: What a CMD_CALL's starts with: a fixarray of 7, then CMD_CALL (5).
CALL_PREFIX = b"\x97\x05"



class CommandPlan:
    """What running one command signature needs, taken from a command the full path accepted."""

    __slots__ = ("arg_fill", "args", "call", "device", "device_index", "call_outs", "fresh", "fresh_slots", "in_descs", "inputs", "kernel",
                 "kw_fill", "kwargs", "label", "max_op_elements", "nested_fill", "new_bytes", "op", "out_descs",
                 "out_id_slots", "out_slots", "single", "validator", "writes", "float_fill", "float_values", "serial",
                 "random", "empty_slots")

    def __init__(self) -> None:
        self.label = ""
        #: the op sent, the op run (its functional form for an out= op with fresh out arguments) and its kernel
        self.op: torch._ops.OpOverload
        self.kernel: torch._ops.OpOverload
        self.call: Any = None
        self.device_index = 0
        self.device: torch.device
        #: an out= op run in its functional form: (name, index in the ids) of each out argument, which must be
        #: a storage the session has not made (nor freed, nor had poisoned)
        self.fresh: list[tuple[str, int, Descriptor]] = []
        self.fresh_slots: list[int] = []  # those and the outputs' indices in the ids
        #: a CALL's plan: how many output storage ids it gives (its ids are [req, tensors..., outputs...]);
        #: -1 for an OP's
        self.call_outs = -1
        #: argument templates: constants in place, tensors filled in per command from ``in_descs``
        self.args: list[Any] = []
        self.arg_fill: list[tuple[int, int]] = []
        self.nested_fill: list[tuple[int, list[Any], list[tuple[int, int]]]] = []
        self.kwargs: dict[str, Any] = {}
        self.kw_fill: list[tuple[str, int]] = []
        #: each float of the command, in key order: (argument position or keyword, index in that argument's
        #: list or -1), filled in per command; or, where float values may change the outputs' metadata,
        #: the floats it was checked with (then ``float_fill`` is empty and other values take the full path)
        self.float_fill: list[tuple[int | str, int]] = []
        self.float_values: tuple[float, ...] | None = None
        #: a small op on a CPU device: it runs on one intra-op thread (genie._C_plans.use_serial)
        self.serial = False
        #: a random op run by a Python runner bound to the session's generator (never native)
        self.random = False
        self.in_descs: list[Descriptor] = []
        #: output descriptors by output position (None: no output wanted), and each one's index in the ids
        self.out_descs: list[Descriptor | None] = []
        self.out_slots: list[int] = []
        #: per input: (its index in the ids, storage_nbytes, offset, sizes, strides, an empty tensor of its
        #: dtype on the plan's device whose new() makes the next one); the ids' indices of the outputs kept
        self.inputs: list[tuple[int, int, int, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []
        self.out_id_slots: list[int] = []
        #: indices in the ids that name storage 0, the empty storage (the key fixes where): such an input is a new
        #: empty tensor each time, as on the full path, and such an output is not kept; Python's plan only
        self.empty_slots: list[int] = []
        #: the one output's (index in the ids, descriptor) when the op has exactly one, kept
        self.single: tuple[int, Descriptor] | None = None
        self.validator: validators.Check | None = None
        self.writes = False
        self.new_bytes = 0
        self.max_op_elements = 0


class _NoPlan(Exception):
    """The command has a shape plans do not cover (internal)."""


def _template(values: list[Any], descs: list[Descriptor], ex: Executor,
              nested: bool) -> tuple[list[Any], list[tuple[int, int]], list[tuple[int, list[Any], list[tuple[int, int]]]]]:
    """A list of decoded values as a template: constants kept, tensors as slots (``descs`` grows)."""
    out: list[Any] = []
    fill: list[tuple[int, int]] = []
    deeper: list[tuple[int, list[Any], list[tuple[int, int]]]] = []
    for position, value in enumerate(values):
        kind = type(value)
        if kind is Descriptor:
            fill.append((position, len(descs)))
            descs.append(value)
            out.append(None)
        elif kind is DeviceRef:
            out.append(ex.device(value.index))
        elif kind is list and nested:
            if any(type(v) is list or type(v) is dict for v in value):
                if any(_has_placeholder(v) for v in value):
                    raise _NoPlan
            inner, inner_fill, _ = _template(value, descs, ex, False)
            if inner_fill:
                deeper.append((position, inner, inner_fill))
                out.append(None)
            else:
                out.append(inner)
        elif kind is list or kind is dict:
            if _has_placeholder(value):
                raise _NoPlan
            out.append(value)
        elif kind in _PLACEHOLDERS:
            raise _NoPlan  # a generator (random ops are not planned)
        else:
            out.append(value)
    return out, fill, deeper


def _holds(value: Any, kinds: frozenset[type]) -> bool:
    """Whether ``value`` is, or a list or dict inside it holds, a value of one of ``kinds``."""
    kind = type(value)
    if kind in kinds:
        return True
    if kind is list:
        return any(_holds(v, kinds) for v in value)
    if kind is dict:
        return any(_holds(v, kinds) for v in value.values())
    return False


def _has_placeholder(value: Any) -> bool:
    return _holds(value, _PLACEHOLDERS)


def _placeholder_types() -> frozenset[type]:
    from genie.server.codec import GeneratorRef

    return frozenset({Descriptor, DeviceRef, GeneratorRef})


_PLACEHOLDERS = _placeholder_types()


def coverable(op_plan: OpFacts) -> bool:
    """Whether commands of this op may get a plan: not ops whose full path does more than run the kernel
    (random ops with a generator argument, Device arguments, the empty family's zeroing). A random op
    without one (native_dropout) runs by its plan with the session's generator bound, as the full path runs it."""
    return not (op_plan.generator_arg or op_plan.devargs or op_plan.uninitialised)


def _float_paths(args: list[Any], kwargs: dict[str, Any]) -> list[tuple[int | str, int]] | None:
    """Where each float of a decoded command's args and kwargs (as sent) sits, in msgpack order: (position
    or keyword, index in a list or -1); None when one sits deeper (no plan fills it in)."""
    paths: list[tuple[int | str, int]] = []
    places: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    for where, value in places:
        kind = type(value)
        if kind is float:
            paths.append((where, -1))
        elif kind is list:
            for i, inner in enumerate(value):
                if type(inner) is float:
                    paths.append((where, i))
                elif type(inner) in (list, dict) and _has_float(inner):
                    return None
        elif kind is dict and _has_float(value):
            return None
    return paths


def _has_float(value: Any) -> bool:
    return _holds(value, _FLOAT)


_FLOAT = frozenset({float})


def build(ex: Executor, cmd: list[Any], keyed: Keyed, op_plan: OpFacts, checked: Plan,
          functional: bool) -> CommandPlan | None:
    """A plan from a CMD_OP the full path just ran without an error (``checked``: its pre-flight answer;
    ``functional``: an out= op whose fresh out arguments it ran in its functional form), or None when its
    shape is not one plans cover. ``cmd[4]`` is the kwargs as sent."""
    _, ids, floats = keyed
    if not coverable(op_plan):
        return None
    paths = _float_paths(cmd[3], cmd[4])
    if paths is None or len(paths) != len(floats):
        return None
    plan = CommandPlan()
    tagged: list[Descriptor] = []  # every tensor tag of args and kwargs, in msgpack order: slot = index in ids
    try:
        plan.args, arg_fill, nested_fill = _template(cmd[3], tagged, ex, True)
        kwargs, kw_fill, nested = _template(list(cmd[4].values()), tagged, ex, False)
    except _NoPlan:
        return None
    if nested:
        return None
    names = list(cmd[4])
    fresh_names = set(op_plan.out_names) if functional else set()
    fresh_slots = {slot for position, slot in kw_fill if names[position] in fresh_names}
    if len(fresh_slots) != len(fresh_names):
        return None
    plan.fresh = [(names[position], slot, tagged[slot]) for position, slot in kw_fill if slot in fresh_slots]
    # Tensors are built for the inputs only (not for fresh out arguments): fills index that list.
    inputs = [slot for slot in range(len(tagged)) if slot not in fresh_slots]
    index = {slot: i for i, slot in enumerate(inputs)}
    plan.arg_fill = [(position, index[slot]) for position, slot in arg_fill]
    plan.nested_fill = [(position, inner, [(i, index[slot]) for i, slot in fill])
                        for position, inner, fill in nested_fill]
    plan.kwargs = {name: value for name, value in zip(names, kwargs, strict=True) if name not in fresh_names}
    plan.kw_fill = [(names[position], index[slot]) for position, slot in kw_fill if slot not in fresh_slots]
    count = len(tagged)
    for out in cmd[5]:
        if out is None:
            plan.out_descs.append(None)
            plan.out_slots.append(-1)
        elif type(out) is Descriptor:
            plan.out_descs.append(out)
            plan.out_slots.append(count)
            count += 1
        else:
            return None  # a plain descriptor list: its id is part of the key, nothing to gain
    # The key's ids are the tensor tags in msgpack order: args, kwargs' values, outs. They must be the
    # descriptors found here, in that order (a mismatch would be a bug: no plan then).
    found = [*(d.storage_id for d in tagged), *(d.storage_id for d in plan.out_descs if d is not None)]
    if found != list(ids):
        log.debug("command plan not made: ids %s differ from the descriptors' %s", ids, found)
        return None
    if floats:
        if floats_decide_metadata(cmd[2], op_plan.op._schema):
            plan.float_values = floats
        elif {where for where, _ in paths} & {position for position, _, _ in plan.nested_fill}:
            return None  # a list of tensors and floats: no schema has one
        else:
            plan.float_fill = paths
    plan.label = cmd[2]
    plan.op = op_plan.op
    plan.kernel = op_plan.functional if functional and op_plan.functional is not None else op_plan.op
    plan.call = plan.kernel._op
    if op_plan.generatorless:  # drawn from the session's generator of the device (an object reseeded in place)
        runner = ex.generators.generatorless(cmd[2], cmd[1])
        if runner is None:
            return None
        plan.call = lambda *args, **kwargs: runner(list(args), kwargs)
        plan.random = True
    plan.device_index = cmd[1]
    plan.device = ex.device(cmd[1])
    validator = validators.check_for(plan.kernel) if plan.kernel is not op_plan.op else op_plan.validator
    plan.validator = None if validator in validators.KEY_FIXED else validator  # the key fixes what it reads
    # The full path re-measures storages after a functional run, and after a generatorless runner, too.
    plan.writes = op_plan.writes or functional or op_plan.generatorless
    plan.new_bytes = checked.new_bytes
    plan.max_op_elements = ex.max_op_elements
    plan.in_descs = [tagged[slot] for slot in inputs]
    plan.inputs = [(slot, d.storage_nbytes, d.offset, d.sizes, d.strides,
                    torch.empty(0, dtype=d.dtype, device=plan.device)) for slot, d in zip(inputs, plan.in_descs,
                                                                                        strict=True)]
    # Storage 0 (empty: `torch.tensor([])`, the empty start of Hugging Face's KV cache) cats and zero_s in every
    # step of a GPT-2's training, through the full path until these plans took it.
    plan.empty_slots = [slot for slot, storage_id in enumerate(ids) if storage_id == 0]
    plan.out_id_slots = [slot for slot in plan.out_slots if slot >= 0 and ids[slot] != 0]
    plan.serial = plan.device.type == "cpu" and serial_size([d.sizes for d in plan.in_descs])
    plan.fresh_slots = sorted(fresh_slots | set(plan.out_id_slots)) if plan.fresh else []
    if len(plan.out_descs) == 1 and plan.out_descs[0] is not None:
        plan.single = (plan.out_slots[0], plan.out_descs[0])
    return plan


def build_call(ex: Executor, cmd: list[Any], keyed: Keyed, op_plan: OpFacts,
               checked: Plan) -> CommandPlan | None:
    """A plan from a CMD_CALL ``[CMD_CALL, req, device, op, args, kwargs(as sent), out_storage_ids]`` the full
    path just answered without an error; its key's ids are the request id, the tensor tags, the output ids."""
    outs = len(cmd[6])
    key, ids, floats = keyed
    plan = build(ex, [CMD_OP, cmd[2], cmd[3], cmd[4], cmd[5], []], (key, ids[1:len(ids) - outs], floats), op_plan,
                 checked, False)
    if plan is not None:
        plan.call_outs = outs
    return plan


def _prepare(ex: Executor, plan: CommandPlan, ids: tuple[int, ...], outputs: int,
             floats: tuple[float, ...]) -> tuple[list[Any], dict[str, Any], dict[int, torch.UntypedStorage]] | None:
    """The per-storage checks and the arguments of a command run by ``plan`` (``outputs``: how many storages
    it may add); None when the full path must run it instead (nothing done then)."""
    store = ex.store
    # The store's maps, read directly: this is the per-command path (genie.server.store.StoreTables).
    tables = store.tables
    storages = tables.storages
    sizes = tables.sizes
    if plan.max_op_elements != ex.max_op_elements or plan.float_values is not None and floats != plan.float_values:
        return None
    try:  # anything unexpected before the kernel (torch refusing to build a tensor): the full path reports it
        used: dict[int, torch.UntypedStorage] = {}
        tensors: list[torch.Tensor] = []
        device = plan.device
        if plan.fresh:  # what _fresh_outs asks of the outputs (else the full path would not run the functional
            for slot in plan.fresh_slots:  # form); asked first, as the full path does, before inputs are made
                if store.seen(ids[slot]):
                    return None
        for slot, nbytes, offset, shape, strides, base in plan.inputs:
            storage_id = ids[slot]
            if not storage_id:  # the empty storage (its place fixed by the key): a new one, as the full path makes
                tensors.append(base.new().set_(zeroed_storage(0, device), offset, shape, strides))
                continue
            storage = storages.get(storage_id)
            if storage is None:
                # Never seen: made here on first use, zero-filled, as the full path makes it (the client makes a
                # tensor without a command: `x.to(torch.bfloat16)` is an empty tensor and a copy_ into it).
                # Freed or poisoned: the full path says what happens.
                if store.seen(storage_id):
                    return None
                storage = store.make(storage_id, nbytes, device)
            elif sizes[storage_id] != nbytes:  # resized since: the full path says what happens
                return None
            used[storage_id] = storage
            # base.new(): an empty tensor of the input's dtype on the plan's device, faster than torch.empty()
            empty = base.new() if storage.device == device else torch.empty(0, dtype=base.dtype, device=storage.device)
            tensors.append(empty.set_(storage, offset, shape, strides))
        if len(storages) + len(tables.poisoned) + outputs > tables.max_storages:
            return None
        if tables.max_bytes and plan.new_bytes > tables.max_bytes - store.bytes_used:
            return None
        args, kwargs = _arguments(plan, tensors, floats)
        label = plan.label
        if plan.validator is not None:
            try:
                plan.validator(label, args, kwargs)
            except Exception:  # noqa: BLE001 - the full path raises it again and records it as it always has
                return None
    except Exception:  # noqa: BLE001
        return None
    ex.set_current(device, used)
    ex.kernels.plan_runs += 1
    return args, kwargs, used


def _arguments(plan: CommandPlan, tensors: list[torch.Tensor],
               floats: tuple[float, ...]) -> tuple[list[Any], dict[str, Any]]:
    """The plan's argument templates with its input tensors and the command's floats filled in."""
    args = plan.args.copy()
    for position, slot in plan.arg_fill:
        args[position] = tensors[slot]
    for position, template, fill in plan.nested_fill:
        inner = template.copy()
        for i, slot in fill:
            inner[i] = tensors[slot]
        args[position] = inner
    kwargs = plan.kwargs
    if plan.kw_fill or plan.float_fill:
        kwargs = kwargs.copy()
        for name, slot in plan.kw_fill:
            kwargs[name] = tensors[slot]
    copied: set[int | str] = set()
    for (where, index), value in zip(plan.float_fill, floats, strict=False):  # empty when the plan compares them
        target: Any = args if type(where) is int else kwargs
        if index < 0:
            target[where] = value
            continue
        if where not in copied:  # a list of floats: this command's own copy
            target[where] = list(target[where])
            copied.add(where)
        target[where][index] = value
    return args, kwargs


def _kernel(plan: CommandPlan, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The plan's bound kernel on the arguments; its decomposition when the device has no kernel (as run_op)."""
    try:
        return plan.call(*args, **kwargs)
    except NotImplementedError as exc:
        if not str(exc).startswith("Could not run"):
            raise
        return run_op(plan.kernel, args, kwargs)


def _timed(ex: Executor, plan: CommandPlan, args: list[Any], kwargs: dict[str, Any],
           used: dict[int, torch.UntypedStorage], ids: tuple[int, ...],
           out_ids: list[int]) -> tuple[Any, dict[str, Any] | None]:
    """Run the kernel by the one kernel wrapper (genie.server.kernel), as the full path does: (result, None),
    or (None, the deferred-error record) when it raised."""
    try:
        if plan.fresh:
            result = ex.kernels.run(plan.label, _fresh_kernel, (ex, plan, args, kwargs, ids), serial=plan.serial,
                                    used=used if plan.writes else None)
        else:
            result = ex.kernels.run(plan.label, _kernel, (plan, args, kwargs), serial=plan.serial,
                                    used=used if plan.writes else None)
    except Exception as exc:  # noqa: BLE001 - the kernel's failure is the command's deferred error
        return None, kernel_error(plan.label, args, kwargs, exc, out_ids)
    return result, None


def _fresh_kernel(ex: Executor, plan: CommandPlan, args: list[Any], kwargs: dict[str, Any],
                  ids: tuple[int, ...]) -> Any:
    """An out= op run in its functional form; where the results do not fit the out arguments (out= may cast),
    the out= form after all, as the full path's _run_fresh does."""
    result = _kernel(plan, args, kwargs)
    if not fits_outs(result, plan.out_descs):
        result = ex.run_out_form(plan.op, args, dict(kwargs),
                                 [(name, desc.with_id(ids[slot])) for name, slot, desc in plan.fresh],
                                 plan.device_index)
    return result


def _out_ids(plan: CommandPlan, ids: tuple[int, ...]) -> list[int]:
    """The storage ids a command run by ``plan`` fills: a CALL's last ``call_outs`` ids, an OP's output slots."""
    if plan.call_outs >= 0:
        return list(ids[len(ids) - plan.call_outs:])
    return [ids[slot] for slot in plan.out_id_slots]


def _finish(ex: Executor, plan: CommandPlan, ids: tuple[int, ...], out_ids: list[int], result: Any,
            failed: dict[str, Any] | None, args: list[Any], kwargs: dict[str, Any],
            used: dict[int, torch.UntypedStorage]) -> None:
    """After the kernel: a CALL is answered (with its error when it failed), an OP's outputs are kept or
    poisoned with the error."""
    if plan.call_outs >= 0:
        if failed is not None:
            ex.fail_call(ids[0], failed, out_ids)
        else:
            ex.finish_call(plan.label, ids[0], result, out_ids)
    elif failed is not None:
        ex.fail_outputs(failed, out_ids)
    else:
        _store(ex, plan, result, ids, args, kwargs, used, out_ids)


def run(ex: Executor, plan: CommandPlan, ids: tuple[int, ...], floats: tuple[float, ...]) -> bool:
    """Run a command by its plan; False (nothing done) when it must take the full path instead."""
    if plan.call_outs >= 0:
        return _run_call(ex, plan, ids, floats)
    prepared = _prepare(ex, plan, ids, len(plan.out_id_slots), floats)
    if prepared is None:
        return False
    args, kwargs, used = prepared
    out_ids = _out_ids(plan, ids)
    result, failed = _timed(ex, plan, args, kwargs, used, ids, out_ids)
    _finish(ex, plan, ids, out_ids, result, failed, args, kwargs, used)
    return True


def _store(ex: Executor, plan: CommandPlan, result: Any, ids: tuple[int, ...], args: list[Any],
           kwargs: dict[str, Any], used: dict[int, torch.UntypedStorage], out_ids: list[int]) -> None:
    """Keep an OP's results (its kernel ran without an error) by the output rule: its common cases
    (genie.server.outputs.adopt_described), else the whole rule."""
    label = plan.label
    failures = adopt_described(result, plan.out_descs, plan.out_slots, ids, ex.store, used)
    if failures is None:
        outs = [d if d is None else d.with_id(ids[slot]) for d, slot in zip(plan.out_descs, plan.out_slots,
                                                                           strict=True)]
        ex.store_outputs_of(label, result, (args, kwargs), outs, out_ids)
    else:
        for failure in failures:
            ex.defer(_error(label, _shapes(args, kwargs), kind_of(failure), _message(failure), out_ids))


def _run_call(ex: Executor, plan: CommandPlan, ids: tuple[int, ...], floats: tuple[float, ...]) -> bool:
    """A CALL by its plan: ids are [req, tensor storages..., output storages...]."""
    outputs = plan.call_outs
    end = len(ids) - outputs
    prepared = _prepare(ex, plan, ids[1:end], outputs, floats)
    if prepared is None:
        return False
    args, kwargs, used = prepared
    out_ids = _out_ids(plan, ids)
    result, failed = _timed(ex, plan, args, kwargs, used, ids, out_ids)
    _finish(ex, plan, ids, out_ids, result, failed, args, kwargs, used)
    return True


def _shapes(args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    return shapes((args, kwargs))


# -- the native runner (genie/csrc/server/runner.cpp) ------------------------------------------------------


def new_runner(store: StorageStore) -> Any:
    """A session's native plan runner bound to ``store`` (its metrics are bound when the executor gets them:
    genie.server.runner_api), or None where the extension was not built."""
    if Runner is None:
        return None
    from genie.transport.record import INLINE
    from genie.wire.frame import MAX_BODY_BYTES, PROTOCOL_VERSION, MsgKind

    runner = Runner(MAX_KEYED_BYTES, MAX_REMEMBERED_FREES)
    runner.set_wire(PROTOCOL_VERSION, int(MsgKind.BATCH), int(MsgKind.REPLY), INLINE, MAX_BODY_BYTES)
    runner.bind(runner_binding(store, None))
    return runner


def native_plan(plan: CommandPlan) -> Any:
    """The native form of ``plan``, or None when it has a shape only Python runs (a validator reads data, a list
    of tensors and other values, a random op's runner) or its constants do not convert as torch converts them."""
    if NativePlan is None or plan.validator is not None or plan.random or plan.empty_slots:
        return None
    try:
        return NativePlan(native_spec(plan))
    except Exception as exc:  # noqa: BLE001 - Python runs it, as before
        log.debug("no native plan for %s: %s", plan.label, exc)
        return None


def finish_native(ex: Executor, plan: CommandPlan, outcome: tuple[Any, ...]) -> None:
    """Finish a command whose kernel the native runner ran (``Runner.run``'s outcome other than a ready
    ``reply``, which the executor sends), as :func:`run` does."""
    kind, ids, used = outcome[0], outcome[2], outcome[-1]
    out_ids = _out_ids(plan, ids)
    ex.set_current(plan.device, used)  # as _prepare does: the rules below read the storages it used
    if kind == "call":  # it ran cleanly and resized nothing: (..., result, used)
        _finish(ex, plan, ids, out_ids, outcome[3], None, [], {}, used)
        return
    if plan.writes:  # as the kernel wrapper does, whether the kernel failed or not
        ex.account_resizes(used)
    # "failed": (..., exception, input tensors, floats, used); "outputs": (..., result, input tensors, floats,
    # used), a result the full output rule decides on or a storage the op resized in place
    args, kwargs = _arguments(plan, outcome[4], outcome[5])
    if kind == "failed":
        _finish(ex, plan, ids, out_ids, None, kernel_error(plan.label, args, kwargs, outcome[3], out_ids), args,
                kwargs, used)
    else:
        _finish(ex, plan, ids, out_ids, outcome[3], None, args, kwargs, used)
