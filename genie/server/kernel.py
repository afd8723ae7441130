"""Running one kernel with its accounting: the one place a session's ops run.

Every path that runs an op calls :meth:`Kernels.run`: the full path (:mod:`genie.server.executor`), the
Python plans (:mod:`genie.server.plans`) and graph replays (:mod:`genie.server.graphs`, one run per
replay). It does, in this order:

- the intra-op threads: one for a small op on a CPU device (:func:`serial_size`), so a result never
  depends on the path that ran it (a parallel reduction may differ from a serial one in its last bits);
- the op clock of a session worker (:mod:`genie.server.isolation.clock`), which ends a session whose op
  runs past ``op_deadline``;
- the kernel;
- the storages an op may have resized in place (``resize_``, ``set_``, ``out=``): grown bytes zeroed and
  counted against the byte quota (:func:`account_resizes`);
- the session's books (``ops_run``) and metrics (:meth:`genie.server.metrics.SessionMetrics.record_op`).

A kernel's exception passes through unchanged, after it is counted; :func:`kernel_error` makes its
deferred-error record (the message scrubbed of server paths and addresses by
:func:`genie.server.records.message`). :func:`zero_fresh` zeroes what the ``empty`` family hands out.

The native runner (genie/csrc/server/runner.cpp) applies the same rules in C++ for the plans it runs (the
same serial threshold, the op clock's page, the same metrics counters, the store's fast adoption) and
hands back to Python what it cannot finish; its runs are counted here by :meth:`Kernels.natively_ran`.
Python per op would cost the native path more than its own work, so its rules are a second
implementation, kept equal by the tests that run tests/server/test_plans.py both ways.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from genie.server import validators
from genie.server.devargs import device_params
from genie.server.isolation.clock import NULL_CLOCK, NullClock, OpClock
from genie.server.metrics import NULL_SESSION_METRICS, SessionMetrics
from genie.server.ops import resolve_op
from genie.server.outputs import functional_of
from genie.server.records import error, message, shapes, tensor_leaves
from genie.server.rng import GENERATORLESS, generator_arg
from genie.server.store import StorageStore, zero_from

try:  # the native plan runner's thread switch (genie/csrc/server/runner.cpp), shared so both sides agree
    from genie._C_plans import SERIAL_BELOW, use_serial
except ImportError:  # pragma: no cover - an install that did not build the extension
    SERIAL_BELOW = 1 << 18

    def use_serial(serial: bool) -> None:
        """Without the extension the intra-op threads stay as torch set them."""


_perf_counter = time.perf_counter


class CommandFailed(Exception):
    """A well-formed command failed; carries its deferred-error record (internal to the server)."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["message"])
        self.record = record


def serial_size(shapes: list[Any]) -> bool:
    """Whether every input tensor of these shapes has fewer than SERIAL_BELOW elements: such an op runs on
    one intra-op thread, since waking the pool costs more than its work. The same rule on every path that
    runs ops (genie/csrc/server/runner.cpp too), so no result depends on the path."""
    return all(math.prod(shape) < SERIAL_BELOW for shape in shapes)


def hands_out_uninitialised(label: str) -> bool:
    """Ops that return memory nobody wrote (the ``empty`` family: ``empty_strided``, ``new_empty``,
    ``_empty_affine_quantized``, ``prims::empty`` ...): their results are zeroed, gaps included, so a
    session never reads bytes another session's tensors left behind. By name, so a new member of the
    family in a later torch release is covered too."""
    return "empty" in label


def may_resize(op: torch._ops.OpOverload) -> bool:
    """In-place and out= ops that may grow a storage (an in-place op like add_ never changes its sizes)."""
    writes = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not writes:
        return False
    name = op._schema.name
    return "resize" in name or name.endswith("::set_") or any(a.kwarg_only for a in writes)


class OpFacts:
    """What running one op name needs, worked out on its first use and shared by every path and session:
    the full path, the plans (and the NativeSpec the native runner is made from) and graph nodes.

    The facts that do not depend on the arguments: the resolved OpOverload (after
    :func:`~genie.server.ops.resolve_op`'s checks, which raise ForbiddenOpError and leave no facts),
    whether a Device-typed argument needs :func:`~genie.server.devargs.check_device_args`, the generator
    argument the session's default fills, whether it is a generatorless random op, the zero-fill rule,
    what it may write or resize, its functional form (an out= op) and its validator.
    """

    __slots__ = ("devargs", "functional", "generator_arg", "generatorless", "op", "out_names", "resizes",
                 "uninitialised", "validator", "writes")

    def __init__(self, name: str, op: torch._ops.OpOverload | None = None) -> None:
        #: ``op``: already resolved from ``name`` (a graph node's), else resolved here
        self.op = resolve_op(name) if op is None else op
        self.devargs = bool(device_params(self.op))
        self.generator_arg = generator_arg(self.op)[1] != ""
        self.generatorless = name in GENERATORLESS
        self.uninitialised = hands_out_uninitialised(name)
        #: whether it may write (and so resize) an argument: in-place, out=, resize_, set_; a functional
        #: op's schema promises it leaves its inputs alone, so their sizes need no second look
        self.writes = any(a.alias_info is not None and a.alias_info.is_write for a in self.op._schema.arguments)
        #: whether it may change a storage's size (resize_, set_, out=): a graph replay then re-measures
        self.resizes = may_resize(self.op)
        #: for an out= op: the names of its out arguments and its functional overload (run for fresh outputs)
        self.out_names, self.functional = functional_of(self.op)
        if self.generator_arg or self.generatorless:
            self.functional = None  # running it and then maybe the out= form would draw twice
        #: its argument check that may read data (genie.server.validators), run before every kernel
        self.validator = validators.check_for(self.op)


#: Op name -> its facts, for every session (facts hold nothing of a session). Bounded: only names that
#: resolved are kept, and there are a few thousand of those.
_facts: dict[str, OpFacts] = {}


def op_facts(name: Any) -> OpFacts:
    """The facts of a client-named op; ForbiddenOpError (from resolve_op) when it may not run."""
    facts = _facts.get(name) if type(name) is str else None
    if facts is None:
        facts = OpFacts(name)  # resolve_op checks the name, whatever its type
        _facts[name] = facts
    return facts


def zero_fresh(result: Any, held: set[int]) -> None:
    """Zero every strided result of an ``empty``-family op that is not over a storage the command used
    (``held``: their data pointers): a fresh result is zeroed whole, gaps included; an out= result lives in
    a storage of the session's own, whose other bytes are the session's data."""
    for t in tensor_leaves(result):
        if t.layout == torch.strided and t.untyped_storage().data_ptr() not in held:
            zero_from(t.untyped_storage(), 0)


def account_resizes(store: StorageStore, used: dict[int, torch.UntypedStorage]) -> None:
    """Storages ``used`` by an op that changed size in place: zero what each gained and count it
    (:meth:`genie.server.store.StorageStore.resized`, which refuses growth past the byte quota)."""
    for storage_id, storage in used.items():
        if storage_id in store:
            before = store.nbytes(storage_id)
            if storage.nbytes() != before:
                if storage.nbytes() > before:
                    zero_from(storage, before)
                store.resized(storage_id)


def kernel_error(label: str, args: Any, kwargs: Any, exc: BaseException, storage_ids: list[int]) -> dict[str, Any]:
    """The deferred-error record of a kernel that raised ``exc`` (kind ``execution``, message scrubbed)."""
    return error(label, shapes((args, kwargs)), "execution", message(exc), storage_ids)


class Kernels:
    """One session's kernel runner: its store, metrics and op clock, and the books of what ran."""

    __slots__ = ("clock", "metrics", "native_runs", "ops_run", "plan_runs", "store")

    def __init__(self, store: StorageStore) -> None:
        self.store = store
        self.metrics: SessionMetrics = NULL_SESSION_METRICS
        self.clock: OpClock | NullClock = NULL_CLOCK
        #: ops run, those of them run by a command plan, and those of them by the native runner
        self.ops_run = 0
        self.plan_runs = 0
        self.native_runs = 0

    def run(self, label: str, call: Callable[..., Any], args: Any = (), kwargs: Any = None, *,
            serial: bool | None, used: dict[int, torch.UntypedStorage] | None = None, ops: int = 1,
            clock_label: str | None = None) -> Any:
        """``call(*args, **kwargs)`` as ``ops`` ops named ``label`` (metrics; the op clock shows
        ``clock_label`` or ``label``). ``serial``: one intra-op thread or the pool (None: as the call sets
        it); ``used``: the storages whose sizes the call may have changed, re-measured afterwards, whether it
        raised or not. Its exception is counted and raised as it is."""
        if serial is not None:
            use_serial(serial)
        clock = self.clock
        started = _perf_counter()  # metrics
        clock.begin(label if clock_label is None else clock_label)  # isolation
        try:
            result = call(*args, **kwargs) if kwargs else call(*args)
        except Exception:
            self.metrics.record_op(label, "error", _perf_counter() - started)  # metrics
            raise
        finally:
            clock.end()  # isolation
            if used is not None:
                account_resizes(self.store, used)
        self.ops_run += ops
        self.metrics.record_op(label, "ok", _perf_counter() - started)  # metrics
        return result

    def natively_ran(self, ran: int, failed: bool) -> None:
        """Count ``ran`` ops the native runner ran (``failed``: the last of them raised)."""
        self.plan_runs += ran
        self.native_runs += ran
        self.ops_run += ran - failed
