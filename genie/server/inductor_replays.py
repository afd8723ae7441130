"""Replayed graphs compiled by inductor on the node (opt-in: ``--compile-replays inductor``).

A graph a client replays (``torch.compile(backend="genie")``: :mod:`genie.server.graphs`) runs its
nodes one kernel at a time, each through Python. With ``compile_replays = "inductor"`` (the node's
option ``--compile-replays``, ``GENIE_COMPILE_REPLAYS``), once a replay's input signature has its gate
(:mod:`genie.server.graph_gate`: the signature's first replay ran node by node, checked in full),
the graph is compiled by inductor, as a local ``torch.compile`` would compile it, and later replays of
that signature call the compiled code. Its outputs go through the same output rule as a node-by-node
replay's (:func:`genie.server.outputs.store_outputs`, in :func:`genie.server.graphs.replay`).

What is compiled, and from what: a ``torch.fx.GraphModule`` built here from the graph's *validated*
nodes (:class:`genie.server.graphs._Node`): each node's target is the ``OpOverload`` the op path's
resolution returned when the graph was defined (never a name looked up anew), its arguments the
node's template with references turned into fx edges, devices already the node's own. The signature's
plain-number inputs (client scalars) become constants of that graph, its tensor inputs placeholders;
it is compiled by inductor's aten-graph entry (``torch._inductor.compile_fx.compile_fx_inner``) with the
signature's tensors as example inputs (fake-propagated, never run by the compile).

Generated code must never carry text from the network, so every constant is checked first: ``None``,
bools, ints, floats, dtypes, devices, layouts and memory formats (and lists of these) pass; a string
passes only as one of a few reviewed values of a few argument names (:data:`ALLOWED_STRINGS`); anything
else leaves the graph node by node. Graphs also stay node by node, as :mod:`genie.server.cuda_graphs`
keeps them, where compiling would change what is checked or computed:

- a node whose validator reads data the graph computes, or an input a node writes to, or replaces an
  argument. Validators run before the compiled code, on every replay, on that replay's inputs, as a CUDA
  graph's do (:mod:`genie.server.replay_checks`, one rule for both): the replay that queues the compile runs
  the nodes one by one with each validator's call recorded as it runs, and the recorded calls, every tensor
  the graph computes standing in as a fake tensor, must run alike on the inputs alone (an embedding
  backward's check reads its indices, an input, and only the shape of its gradient, computed by the graph);
- a node that would draw random numbers from a generator other than the session's
  (:func:`genie.server.rng.draws_outside_session`, the rule CUDA graphs use too). A node that draws from the
  session's generator (dropout, the generatorless random ops: :func:`genie.server.rng.node_draws`) compiles:
  inductor's code draws its seeds from the device's default generator, so each compiled run of such a graph
  swaps the session's default generator's state into the device's default generator and back after it
  (:func:`_session_draws`), under one lock of the process (the default generator is the process's, shared by
  the sessions of an ``--isolation none`` node; nothing else on a node draws from it). The numbers are
  inductor's (its philox), drawn from the session's seed: a session seeded alike draws alike, not the numbers
  the same nodes draw one by one (as a local ``torch.compile`` does not draw eager's);
- a node that may resize a storage (``resize_``, ``set_``, ``out=``);
- a node of the ``empty`` family (node by node it is zeroed; compiled code would hand out what the
  allocator held);
- a replay whose tensor inputs share a storage when a node writes to its arguments (inductor assumes
  distinct inputs; AOTAutograd's ``copy_`` into inputs and genie's reinplaced ``_foreach_*_`` ops are
  honoured for distinct inputs: tests/device/test_compile_inductor.py).

When: the replay that first finds its signature admitted builds the fx graph and fake tensors with its
inputs' metadata (milliseconds) and queues the compile on the process's compiler thread, off the
critical path: it is not on the op clock, and replays (this one included) run node by node until it has
finished (10-60 s on a loaded 2-core CPU host); the first replay after that runs the compiled code. A
client's sync point therefore never waits for a compile (its ``op_timeout`` could not cover one). The
compiler thread works on fake tensors only, never on a session's tensors, one compile at a time per
process; it is a daemon: a session's end does not wait for it. It shares the process's GIL with the session,
so the session's replays are slower while it compiles (docs/compile.md); each compile queued is logged at
INFO (``queued for inductor``) before its outcome, so a tool can wait for all of them before timing.

A compile that fails leaves that graph node by node for good, logged once. Bounds: a graph is compiled
for at most :data:`MAX_SIGNATURES` input signatures, a session keeps at most :data:`MAX_COMPILED`
compiled graphs (queued ones included); past them, replays run node by node. Inductor's caches live in
a temporary directory of the compiling process (a session worker, or the node with ``--isolation
none``), made at its first compile and removed when it exits; remote caches are off; inductor compiles
in the thread itself (``compile_threads`` 1: no pool of compile processes).
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from genie.server.kernel import CommandFailed
from genie.server.per_session import PerSession
from genie.server.records import error as _error
from genie.server.records import kind_of as _kind_of
from genie.server.records import message as _message
from genie.server.replay_checks import HoistedCheckFailed, HoistedChecks, NotHoistable, recording
from genie.server.rng import draws_outside_session, node_draws
from genie.wire.graph import Ref

if TYPE_CHECKING:
    from genie.server.executor import Executor

log = logging.getLogger("genie.server.inductor_replays")

#: The values of ``compile_replays``.
MODES = ("off", "inductor")
#: Input signatures one graph is compiled for at most; later new signatures run node by node.
MAX_SIGNATURES = 3
#: Compiled graphs (signatures included) one session keeps at most: each holds generated code and its buffers.
MAX_COMPILED = 16
#: The strings a compiled graph may carry, by argument name: each is a fixed choice of the op's schema that
#: selects a kernel variant (gelu's approximation, div's rounding, scatter_reduce's reduction, searchsorted's
#: side). Any other string argument (or one of these names with another value) keeps the graph node by node.
ALLOWED_STRINGS: dict[str, frozenset[str]] = {
    "approximate": frozenset({"none", "tanh"}),
    "rounding_mode": frozenset({"floor", "trunc"}),
    "reduce": frozenset({"sum", "prod", "mean", "amax", "amin"}),
    "side": frozenset({"left", "right"}),
}
#: The names under which the session's metrics count compiles (ok or error) and replays run compiled, besides the
#: ``genie::replay`` every replay is counted as.
COMPILE_OP = "genie::inductor_compile"
REPLAY_OP = "genie::replay_inductor"
#: Constant types a compiled graph may carry (exact types: a subclass is refused).
_CONSTANTS = (type(None), bool, int, float, torch.dtype, torch.device, torch.layout, torch.memory_format)


class Ineligible(Exception):
    """Why a graph stays node by node (internal)."""


class _Compiled:
    """One graph's compiled forms, by compile key (signature, input offsets, input aliasing)."""

    __slots__ = ("callables", "checks", "draws", "failed", "full", "jobs", "warned", "writes")

    def __init__(self) -> None:
        self.callables: dict[Any, Any] = {}
        self.jobs: dict[Any, _Job] = {}  # compiles queued or running, by compile key
        self.warned = False  # a failed compile was logged
        self.failed = False
        self.full = False  # MAX_SIGNATURES reached (logged once)
        self.writes = False  # a node writes to its arguments
        self.draws = False  # a node draws from the session's generator: each compiled run swaps it in
        #: the validators' calls recorded by the replay that queued each compile, run before the compiled code
        self.checks: dict[Any, HoistedChecks] = {}


class _Session:
    __slots__ = ("compiles", "graphs", "mode", "seconds")

    def __init__(self) -> None:
        self.mode = "off"
        self.graphs: dict[int, _Compiled] = {}
        self.compiles = 0  # compiled callables kept
        self.seconds = 0.0  # compile time spent


_sessions: PerSession[_Session] = PerSession(_Session)


def configure(executor: Executor, mode: str) -> None:
    """Set ``executor``'s session to ``mode`` (one of :data:`MODES`; the node's ``compile_replays``)."""
    if mode not in MODES:
        raise ValueError(f"compile_replays must be one of {MODES}, got {mode!r}")
    _sessions.get(executor).mode = mode


def stats(executor: Executor, graph_id: int) -> dict[str, Any]:
    """How graph ``graph_id`` of ``executor``'s session runs (for tests and tools)."""
    state = _sessions.get(executor)
    compiled = state.graphs.get(graph_id)
    if compiled is None:
        return {"mode": state.mode, "compiled": 0, "eager": False}
    return {"mode": state.mode, "compiled": len(compiled.callables), "eager": compiled.failed}


# -- building the fx graph --------------------------------------------------------------------------------


def check_graph(graph: Any) -> None:
    """Raise :class:`Ineligible` when ``graph`` (a :class:`genie.server.graphs.Graph`) must stay node by node for what
    its nodes are (whether its validators can run ahead of it is found by running it: :func:`run`)."""
    if graph.resizes:
        raise Ineligible("a node may resize a storage")
    for i, node in enumerate(graph.nodes):
        where = f"node {i} ({node.op.name()})"
        if draws_outside_session(node.op, node.label, node.args, node.kwargs):
            raise Ineligible(f"{where} draws random numbers from a generator other than the session's")
        if node.zero:
            raise Ineligible(f"{where} hands out uninitialised memory, zeroed node by node")
        names = [a.name for a in node.op._schema.arguments]
        for p, value in enumerate(node.args):
            _check_constant(value, names[p] if p < len(names) else "", where)
        for name, value in node.kwargs.items():
            _check_constant(value, name, where)


def _check_constant(value: Any, name: str, where: str) -> None:
    kind = type(value)
    if kind is Ref or kind in _CONSTANTS:
        return
    if kind is list or kind is tuple:
        for v in value:
            _check_constant(v, name, where)
        return
    if kind is str:
        if value in ALLOWED_STRINGS.get(name, ()):
            return
        raise Ineligible(f"{where} has a string argument {name or '?'!r} outside the reviewed values "
                         "(genie.server.inductor_replays.ALLOWED_STRINGS)")
    raise Ineligible(f"{where} has a {kind.__name__} argument {name or '?'!r}")


def build(graph: Any, inputs: list[Any]) -> tuple[torch.fx.GraphModule, list[int]]:
    """The fx graph of ``graph`` for these input values (numbers become constants), and the input slots that
    are its placeholders, in order. Raises :class:`Ineligible`."""
    g = torch.fx.Graph()
    slots: list[Any] = []
    placeholders: list[int] = []
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            slots.append(g.placeholder(f"input_{i}"))
            placeholders.append(i)
        elif type(value) in (bool, int, float):
            slots.append(value)
        else:
            raise Ineligible(f"input {i} is a {type(value).__name__}")
    items: dict[tuple[int, int], Any] = {}

    def ref(r: Ref) -> Any:
        value = slots[r.slot]
        if r.item < 0:
            return value
        if not isinstance(value, torch.fx.Node):
            raise Ineligible(f"slot {r.slot} is not a sequence")
        key = (r.slot, r.item)
        if key not in items:
            items[key] = g.call_function(operator.getitem, (value, r.item))
        return items[key]

    def arg(value: Any) -> Any:
        kind = type(value)
        if kind is Ref:
            return ref(value)
        if kind is list or kind is tuple:
            return [arg(v) for v in value]
        return value

    for node in graph.nodes:
        slots.append(g.call_function(node.op, tuple(arg(a) for a in node.args),
                                     {k: arg(v) for k, v in node.kwargs.items()}))
    g.output([None if r is None else ref(r) for r in graph.outputs])
    return torch.fx.GraphModule(torch.nn.Module(), g), placeholders


# -- the compiling process --------------------------------------------------------------------------------


class _Job:
    """One compile handed to the process's compiler thread; ``done`` is set once ``fn`` or ``error`` is."""

    __slots__ = ("done", "error", "fn", "seconds")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.fn: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0


_compiler: tuple[int, queue.SimpleQueue[Any]] | None = None  # (pid, its queue): a forked worker starts its own
_compiler_lock = threading.Lock()
_cache_dir: tuple[int, str] | None = None


def _prepare_process() -> str:
    """This process's inductor cache directory (made on first use, removed at exit) and in-process compiles."""
    global _cache_dir
    if _cache_dir is None or _cache_dir[0] != os.getpid():
        directory = tempfile.mkdtemp(prefix="genie-inductor-")  # mode 0700
        _cache_dir = (os.getpid(), directory)
        atexit.register(shutil.rmtree, directory, True)
    directory = _cache_dir[1]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    os.environ["TRITON_CACHE_DIR"] = os.path.join(directory, "triton")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # read when inductor's config is first imported
    return directory


def _submit(compiled: _Compiled, gm: torch.fx.GraphModule, example: list[Any], label: str) -> _Job:
    """Queue a compile on this process's compiler thread (started on first use)."""
    global _compiler
    with _compiler_lock:
        if _compiler is None or _compiler[0] != os.getpid():
            _prepare_process()  # before the thread imports inductor
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            threading.Thread(target=_compile_loop, args=(jobs,), name="genie-inductor", daemon=True).start()
            _compiler = (os.getpid(), jobs)
    job = _Job()
    _compiler[1].put((job, compiled, gm, example, label))
    return job


def _compile_loop(jobs: queue.SimpleQueue[Any]) -> None:
    """The compiler thread: one compile at a time, off every session's critical path; a daemon (a worker's exit
    does not wait for it)."""
    while True:
        job, compiled, gm, example, label = jobs.get()
        started = time.perf_counter()
        try:
            job.fn = _compile(gm, example, compiled.draws)
        except BaseException as exc:  # noqa: BLE001 - whatever inductor raises leaves that graph node by node
            job.error = exc
        job.seconds = time.perf_counter() - started
        job.done.set()  # before the log line: a replay after it finds the outcome
        if job.error is not None:
            if not compiled.warned:
                compiled.warned = True
                text = str(job.error).strip()
                log.warning("%s: inductor could not compile it (%s: %s); it runs node by node", label,
                            type(job.error).__name__, text.splitlines()[0][:300] if text else "")
        else:
            log.info("%s compiled by inductor in %.1f s (%d fx nodes)", label, job.seconds, len(gm.graph.nodes))


def _compile(gm: torch.fx.GraphModule, example: list[Any], draws: bool = False) -> Any:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    patches = {"compile_threads": 1, "fx_graph_remote_cache": False, "autotune_remote_cache": False}
    with torch.no_grad(), inductor_config.patch({k: v for k, v in patches.items() if hasattr(inductor_config, k)}):
        return compile_fx_inner(decompose(gm, example, draws), example)


def decompose(gm: torch.fx.GraphModule, example: list[Any], draws: bool = False) -> torch.fx.GraphModule:
    """``gm`` as inductor's lowering takes it, traced on the fake inputs ``example`` (nothing runs; call it under
    ``torch.no_grad()``). ``gm`` is aot_eager's graph (genie's backend): inductor's lowering expects its own
    decompositions applied first, as torch.compile's AOTAutograd pass applies them. Each node's output keeps the
    strides eager kernels give it (:class:`_EagerStrides`). ``draws``: random ops become inductor's own, seeded
    from the device's default generator at each run (as torch.compile's joint-graph passes turn them;
    :func:`_session_draws` puts the session's state there)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.replace_random import replace_random_passes
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, detect_fake_mode(example)).propagate_dont_convert_inputs(*example)
    decomposed = make_fx(_EagerStrides(gm).run, decomposition_table=select_decomp_table(),
                         tracing_mode="fake")(*example)
    if draws:
        with V.set_fake_mode(detect_fake_mode(example)):
            replace_random_passes(decomposed)
        decomposed.recompile()
    return decomposed


class _EagerStrides(torch.fx.Interpreter):
    """Runs a graph whose nodes carry their eager outputs (``meta["val"]``, from a fake propagation without
    decompositions) and gives each new tensor a node makes the strides of its eager output: a copy where a
    decomposition made other strides, nothing where it did not.

    The graph was recorded by the client with eager kernels, so its ``view`` nodes assume eager strides. Some of
    inductor's decompositions make others: its ``cat`` of one non-empty tensor (and empty ones) is a ``clone``,
    which keeps a transposed input's strides where ATen's ``cat`` makes a contiguous tensor, and a GPT-2 forward's
    later ``view`` then failed ("Cannot view a tensor with shape [2, 2, 32, 64] and strides (4096, 32, 1, 64)").
    A local ``torch.compile`` meets no such mismatch: it traces the model with the decompositions from the start.
    Outputs of views and of in-place and ``out=`` ops follow their inputs and are left alone."""

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return out
        if any(r.alias_info is not None for r in n.target._schema.returns):
            return out
        eager = n.meta.get("val")
        if isinstance(out, (tuple, list)) and isinstance(eager, (tuple, list)) and len(out) == len(eager):
            return type(out)(_as_eager(o, e) for o, e in zip(out, eager, strict=True))
        return _as_eager(out, eager)


def _as_eager(t: Any, eager: Any) -> Any:
    if (not isinstance(t, torch.Tensor) or not isinstance(eager, torch.Tensor) or t.shape != eager.shape
            or t.dtype != eager.dtype or t.stride() == eager.stride()):
        return t
    return torch.empty_strided(t.shape, eager.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _fakes(tensors: list[torch.Tensor]) -> list[Any]:
    """Fake tensors with the inputs' metadata (no data, no reference to their storages), made by the session's
    thread: the compiler thread never touches a session's tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    return [mode.from_tensor(t) for t in tensors]


# -- replays ---------------------------------------------------------------------------------------------


def _layout_key(inputs: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensor inputs' storage offsets and, for each, the first input over the same storage (itself when
    none before it is)."""
    offsets: list[int] = []
    shares: list[int] = []
    seen: dict[int, int] = {}
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            offsets.append(int(value.storage_offset()))
            key = value.untyped_storage().data_ptr()
            shares.append(seen.setdefault(key, i) if key else i)
    return tuple(offsets), tuple(shares)


def run(ex: Executor, graph: Any, env: list[Any], held: set[int], label: str, key: Any, storage_ids: list[int],
        run_nodes: Callable[..., None]) -> bool:
    """Run an admitted replay of ``graph`` compiled by inductor: its outputs left in ``env`` where the output
    references read them. The replay that queues the compile runs the nodes itself (``run_nodes(ex, graph, env,
    held, label, storage_ids, None)``, recording the validators' calls). False when the session's mode is off,
    the graph or this replay must run node by node, or its compiled form is not ready: the caller then runs
    the nodes."""
    state = _sessions.get(ex)
    if state.mode != "inductor" or key is None:
        return False
    compiled = state.graphs.get(graph.graph_id)
    if compiled is None:
        compiled = state.graphs[graph.graph_id] = _Compiled()
        compiled.writes = graph.writes
    if compiled.failed:
        return False
    inputs = env[:graph.inputs]
    offsets, shares = _layout_key(inputs)
    if compiled.writes and len(set(shares)) < len(shares):
        return False  # inputs share a storage and a node writes: node by node, this replay only
    ckey = (key, offsets, shares)
    fn = compiled.callables.get(ckey)
    if fn is None:
        if ckey not in compiled.jobs:
            return _queue(ex, state, compiled, graph, env, held, ckey, label, storage_ids, run_nodes)
        fn = _finished(ex, state, compiled, ckey)
        if fn is None:
            return False
    checks = compiled.checks.get(ckey)
    if checks:
        try:  # the validators, before the compiled code, on this replay's inputs
            checks.run(env)
        except HoistedCheckFailed as failed:
            node = graph.nodes[failed.node]
            raise CommandFailed(_error(f"{label} node {failed.node} ({node.label})", [], _kind_of(failed.error),
                                       _message(failed.error), storage_ids)) from None
    tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
    started = time.perf_counter()
    try:
        if compiled.draws:
            with _session_draws(ex, graph.device_index):
                outputs = fn(tensors)
        else:
            outputs = fn(tensors)
    except Exception as exc:
        ex.metrics.record_op(REPLAY_OP, "error", time.perf_counter() - started)
        raise CommandFailed(_error(f"{label} (compiled by inductor)", [], _kind_of(exc), _message(exc),
                                   storage_ids)) from None
    ex.metrics.record_op(REPLAY_OP, "ok", time.perf_counter() - started)
    for ref, value in zip(graph.outputs, outputs, strict=True):
        if ref is None:
            continue
        if ref.item < 0:
            env[ref.slot] = value
        else:
            items = env[ref.slot]
            if type(items) is not dict:
                items = env[ref.slot] = {}
            items[ref.item] = value  # read back as env[slot][item] (genie.server.graphs._value)
    return True


#: Held while compiled code draws from a device's default generator with a session's state in it (_session_draws).
_DEFAULT_GENERATOR = threading.Lock()


@contextmanager
def _session_draws(ex: Executor, device_index: int) -> Iterator[None]:
    """Inside, the default generator of the device ``device_index`` names holds the state of the session's default
    generator of that device; after, the session's generator holds what was drawn and the default generator its
    own state again."""
    device = ex.device(device_index)
    session = ex.generators.get(device_index, 0)
    if device.type == "cuda":
        default = torch.cuda.default_generators[device.index if device.index is not None
                                                else torch.cuda.current_device()]
    else:
        default = torch.default_generator
    with _DEFAULT_GENERATOR:
        saved = default.get_state()
        default.set_state(session.get_state())
        try:
            yield
        finally:
            session.set_state(default.get_state())
            default.set_state(saved)


def _finished(ex: Executor, state: _Session, compiled: _Compiled, ckey: Any) -> Any:
    """The compiled form for ``ckey`` when its compile has finished; else None (still compiling, or failed)."""
    job = compiled.jobs[ckey]
    if not job.done.is_set():
        return None  # still compiling: node by node meanwhile
    del compiled.jobs[ckey]
    ex.metrics.record_op(COMPILE_OP, "ok" if job.error is None else "error", job.seconds)
    state.seconds += job.seconds
    if job.error is not None:  # node by node from now on (logged once by the compiler thread)
        compiled.failed = True
        state.compiles -= 1
        return None
    compiled.callables[ckey] = job.fn
    return job.fn


def _queue(ex: Executor, state: _Session, compiled: _Compiled, graph: Any, env: list[Any], held: set[int],
           ckey: Any, label: str, storage_ids: list[int], run_nodes: Callable[..., None]) -> bool:
    """Queue the compile of ``graph`` for ``ckey`` where it may be compiled, its nodes run now with each validator's
    call recorded (True: this replay ran); False, with nothing run, where the graph stays node by node."""
    if len(compiled.callables) + len(compiled.jobs) >= MAX_SIGNATURES or state.compiles >= MAX_COMPILED:
        if not compiled.full:
            compiled.full = True
            log.info("%s: new input signatures run node by node (at most %d signatures a graph, %d compiled "
                     "graphs a session)", label, MAX_SIGNATURES, MAX_COMPILED)
        return False
    inputs = env[:graph.inputs]
    try:
        check_graph(graph)
        compiled.draws = any(node_draws(n.op, n.label, n.args, n.kwargs) for n in graph.nodes)
        gm, placeholders = build(graph, inputs)
    except Ineligible as why:
        compiled.failed = True
        log.info("%s stays node by node under --compile-replays inductor: %s", label, why)
        return False
    example = _fakes([inputs[i] for i in placeholders])
    with recording(graph, inputs, run_too=True) as checks:
        run_nodes(ex, graph, env, held, label, storage_ids, None)
    try:
        checks.verify(env)
    except NotHoistable as why:
        compiled.failed = True
        log.info("%s stays node by node under --compile-replays inductor: %s", label, why)
        return True
    compiled.checks[ckey] = checks
    state.compiles += 1
    compiled.jobs[ckey] = _submit(compiled, gm, example, label)
    # one line per compile queued, before its outcome's: a tool (benchmarks/bench_graph.py) waits for every queued
    # compile by counting these against the outcomes, since replays run while a compile runs pay for it (GIL)
    log.info("%s queued for inductor (%d fx nodes, signature %d of at most %d)", label, len(gm.graph.nodes),
             len(compiled.callables) + len(compiled.jobs), MAX_SIGNATURES)
    return True
