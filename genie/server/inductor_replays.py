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

- a node whose validator reads data (it must run before its node on every replay);
- a node that draws random numbers (the session's generators are not inductor's);
- a node that may resize a storage (``resize_``, ``set_``, ``out=``);
- a node of the ``empty`` family (node by node it is zeroed; compiled code would hand out what the
  allocator held);
- a replay whose tensor inputs share a storage when a node writes to its arguments (inductor assumes
  distinct inputs; AOTAutograd's ``copy_`` into inputs and genie's reinplaced ``_foreach_*_`` ops are
  honoured for distinct inputs: tests/device/test_compile_inductor.py).

A compile that fails leaves that graph node by node for good, logged once. Bounds: a graph is compiled
for at most :data:`MAX_SIGNATURES` input signatures, a session keeps at most :data:`MAX_COMPILED`
compiled graphs; past them, replays run node by node. The compile runs on the replay that first finds
its signature admitted, inside that replay's op clock: it counts against ``op_deadline`` (seconds to a
minute on a loaded CPU host), and nothing else of the session runs meanwhile. Inductor's caches live in
a temporary directory of the compiling process (a session worker, or the node with ``--isolation
none``), made at its first compile and removed when it exits; remote caches are off; compiles run in
the process (``compile_threads`` 1), under one lock per process.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from genie.server.kernel import CommandFailed
from genie.server.per_session import PerSession
from genie.server.records import error as _error
from genie.server.records import kind_of as _kind_of
from genie.server.records import message as _message
from genie.server.rng import GENERATORLESS
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

    __slots__ = ("callables", "failed", "full", "writes")

    def __init__(self) -> None:
        self.callables: dict[Any, Any] = {}
        self.failed = False
        self.full = False  # MAX_SIGNATURES reached (logged once)
        self.writes = False  # a node writes to its arguments


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


def _writes(op: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def check_graph(graph: Any) -> None:
    """Raise :class:`Ineligible` when ``graph`` (a :class:`genie.server.graphs.Graph`) must stay node by node."""
    if graph.resizes:
        raise Ineligible("a node may resize a storage")
    for i, node in enumerate(graph.nodes):
        where = f"node {i} ({node.op.name()})"
        if node.validator is not None:
            raise Ineligible(f"{where} has a check that reads data before every run")
        if node.label in GENERATORLESS or any("Generator" in str(a.type) for a in node.op._schema.arguments):
            raise Ineligible(f"{where} draws random numbers from the session's generators")
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
    check_graph(graph)
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

_lock = threading.Lock()
_cache_dir: tuple[int, str] | None = None  # (pid, directory): a forked worker makes its own


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


def _compile(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Any:
    _prepare_process()
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    patches = {"compile_threads": 1, "fx_graph_remote_cache": False, "autotune_remote_cache": False}
    with _lock, inductor_config.patch({k: v for k, v in patches.items() if hasattr(inductor_config, k)}):
        # The graph is aot_eager's (genie's backend): inductor's lowering expects its own decompositions applied
        # first, as torch.compile's AOTAutograd pass applies them. Traced on fake tensors: nothing runs.
        decomposed = make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="fake")(*example)
        return compile_fx_inner(decomposed, example)


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


def run(ex: Executor, graph: Any, env: list[Any], label: str, key: Any, storage_ids: list[int]) -> bool:
    """Run an admitted replay of ``graph`` compiled by inductor (compiled now if its signature has no compiled
    form yet): its outputs left in ``env`` where the output references read them. False when the session's mode
    is off or the replay must run node by node (the caller then runs the nodes)."""
    state = _sessions.get(ex)
    if state.mode != "inductor" or key is None:
        return False
    compiled = state.graphs.get(graph.graph_id)
    if compiled is None:
        compiled = state.graphs[graph.graph_id] = _Compiled()
        compiled.writes = any(_writes(node.op) for node in graph.nodes)
    if compiled.failed:
        return False
    inputs = env[:graph.inputs]
    offsets, shares = _layout_key(inputs)
    if compiled.writes and len(set(shares)) < len(shares):
        return False  # inputs share a storage and a node writes: node by node, this replay only
    ckey = (key, offsets, shares)
    fn = compiled.callables.get(ckey)
    if fn is None:
        fn = _compile_for(ex, state, compiled, graph, inputs, ckey, label)
        if fn is None:
            return False
    tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
    started = time.perf_counter()
    try:
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
            held = env[ref.slot]
            if type(held) is not dict:
                held = env[ref.slot] = {}
            held[ref.item] = value  # read back as env[slot][item] (genie.server.graphs._value)
    return True


def _compile_for(ex: Executor, state: _Session, compiled: _Compiled, graph: Any, inputs: list[Any], ckey: Any,
                 label: str) -> Any:
    if len(compiled.callables) >= MAX_SIGNATURES or state.compiles >= MAX_COMPILED:
        if not compiled.full:
            compiled.full = True
            log.info("%s: new input signatures run node by node (at most %d signatures a graph, %d compiled "
                     "graphs a session)", label, MAX_SIGNATURES, MAX_COMPILED)
        return None
    try:
        gm, placeholders = build(graph, inputs)
    except Ineligible as why:
        compiled.failed = True
        log.info("%s stays node by node under --compile-replays inductor: %s", label, why)
        return None
    started = time.perf_counter()
    try:
        fn = _compile(gm, [inputs[i] for i in placeholders])
    except Exception as exc:  # inductor could not compile it: node by node from now on
        compiled.failed = True
        ex.metrics.record_op(COMPILE_OP, "error", time.perf_counter() - started)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        log.warning("%s: inductor could not compile it (%s: %s); it runs node by node", label,
                    type(exc).__name__, first)
        return None
    seconds = time.perf_counter() - started
    ex.metrics.record_op(COMPILE_OP, "ok", seconds)
    state.seconds += seconds
    state.compiles += 1
    compiled.callables[ckey] = fn
    log.info("%s compiled by inductor in %.1f s (%d nodes, %d tensor inputs)", label, seconds, len(graph.nodes),
             len(placeholders))
    return fn
