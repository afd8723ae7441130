"""Captured graphs of one session: defined once, validated op by op, replayed by one command each.

``torch.compile(model, backend="genie")`` sends each aten graph AOTAutograd produces once
(``CMD_GRAPH``, schema in :mod:`genie.wire.graph`) and then one ``CMD_REPLAY`` per call. A
definition is checked whole before it is kept:

- every node's op goes through :func:`genie.server.ops.resolve_op`, the same resolution, deny
  list and namespace rules as a single ``CMD_OP`` (a graph can never run an op the op path
  refuses); Device-typed arguments through :func:`genie.server.devargs.check_device_args`;
- every node's arguments pass the pre-flight's refusals that need no tensor
  (:func:`genie.server.preflight.check_arguments`: dtype, layout and memory-format arguments of
  their own types, strided layouts, no ``pin_memory``, split counts), so such a graph is refused
  when it is defined;
- every reference names an earlier slot (no cycles, no forward references), outputs too.

A replay resolves its inputs like an op's arguments (bounds-checked descriptors over the
session's storages), runs the nodes in order with the op path's runner (decompositions for
missing kernels, the session's generators for random ops, the ``empty`` family zeroed, storages
grown by ``resize_`` zeroed and counted), drops each intermediate after its last use, and stores
the outputs by the output rule of ``CMD_OP`` (:func:`genie.server.outputs.store_outputs`): the
client's descriptors are checked, never trusted. A failure is a deferred error naming the graph,
the node and its op, and poisons the replay's output storages, exactly as a failed op does.

The replay gate (:mod:`genie.server.graph_gate`): every node passes the op path's pre-flight
(:func:`genie.server.preflight.check`) on its actual arguments, in full on the first replay of an
input signature (the inputs' shapes, strides, dtypes and plain values), whose findings then admit
later replays of that signature by one comparison with the quota left, plus the checks that read
data (validators, index checks) before each node that has one. The op clock runs from the first
check to the last node, so a replay past ``op_deadline`` ends the session as an op would; storages
a node grew count against the quota (:meth:`genie.server.store.StorageStore.resized` refuses growth
past it).

An admitted replay runs its nodes in C++ (``genie._C_plans.GraphProgram``, built from the validated nodes by
:func:`genie.server.runner_api.graph_node_spec` on the graph's first admitted replay): the same calls, thread rule,
zeroing and releases as the Python loop here, whose code (:func:`_run_node`, through ``_program``'s callable) still
runs every node with a validator or a session-bound runner, and a node with no kernel.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from genie.errors import ForbiddenOpError, FrameError, GenieError, ProtocolError, QuotaExceededError
from genie.server import cuda_graphs, inductor_replays, preflight
from genie.server.codec import Descriptor, DeviceRef, GeneratorRef, is_int
from genie.server.devargs import check_device_args
from genie.server.graph_gate import CheckedReplay, Gate
from genie.server.kernel import CommandFailed, OpFacts, op_facts, serial_size, use_serial, zero_fresh
from genie.server.kernel import may_resize as _may_resize  # noqa: F401 - tests read the rule here
from genie.server.ops import run_op
from genie.server.outputs import OutputMismatch
from genie.server.per_session import PerSession
from genie.server.records import error as _error
from genie.server.records import kind_of as _kind_of
from genie.server.records import message as _message
from genie.server.records import shapes, tensor_leaves
from genie.server.replay_checks import HoistedCheckFailed, HoistedChecks
from genie.server.rng import GENERATORLESS
from genie.server.runner_api import graph_node_spec
from genie.wire.graph import Definition, Ref, decode_definition

if TYPE_CHECKING:
    from genie.server.executor import Executor

GraphProgram: Any
try:  # admitted replays' nodes in C++ (genie/csrc/server/graph_program.cpp); without it they run in Python
    from genie._C_plans import GraphProgram  # type: ignore[no-redef]
except ImportError:  # pragma: no cover - an install that did not build the extension
    GraphProgram = None

#: Most graphs, and most nodes over all graphs, one session may keep.
MAX_GRAPHS = 4096
MAX_SESSION_NODES = 1 << 21
#: Graph ids: positive 63-bit integers.
_MAX_ID = (1 << 63) - 1
#: Input signatures whose gate one graph keeps (emptied when full: ever new shapes only cost checked replays).
MAX_GATES = 64

#: genie.wire.graph.KERNELS -> dispatch keys (a fixed table: nothing received is looked up as an attribute).
_DISPATCH_KEYS = {"CompositeExplicitAutograd": torch._C.DispatchKey.CompositeExplicitAutograd,
                  "CompositeExplicitAutogradNonFunctional":
                      torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional}


class _Node:
    """One validated node, compiled into what a replay runs: the callable, an argument template and where
    the node's references are filled in. Built once at CMD_GRAPH time from the resolved OpOverload (never
    from a client string), so a replay does no lookups per node."""

    __slots__ = ("args", "call", "fallback", "kernel", "kw_refs", "kwargs", "label", "nested", "op", "refs", "release",
                 "resizes", "validator", "writes", "zero")

    def __init__(self, op: torch._ops.OpOverload, label: str, args: list[Any], kwargs: dict[str, Any],
                 call: Any, fallback: bool, facts: OpFacts | None = None,
                 kernel: torch._C.DispatchKey | None = None) -> None:
        if facts is None:
            facts = OpFacts(label, op)
        self.op = op
        self.label = label
        #: the callable run as call(*args, **kwargs): the op's own, its composite kernel's or a session-bound
        #: generatorless runner (see _callable)
        self.call = call
        #: whether a NotImplementedError (no kernel on this device) runs the op path's decomposition instead
        self.fallback = fallback
        #: the composite kernel ``call`` runs (the node asked for it), or None
        self.kernel = kernel
        #: the argument template: constants as they are, references filled per replay into a copy
        self.args = args
        self.kwargs = kwargs
        #: top-level references (position, slot, item): the common case, filled without a call
        self.refs = tuple((p, a.slot, a.item) for p, a in enumerate(args) if type(a) is Ref)
        #: positions of lists holding references (a tensor list: cat, stack, _foreach_*), rebuilt per replay
        self.nested = tuple((p, a) for p, a in enumerate(args) if type(a) is list and _has_ref(a))
        self.kw_refs = tuple((k, v) for k, v in kwargs.items() if _has_ref(v))
        #: the empty family hands out memory nobody wrote: zeroed, as for CMD_OP
        self.zero = facts.uninitialised
        #: whether it may change a storage's size (resize_, set_, out=): the replay then counts what storages gained
        self.resizes = facts.resizes
        #: whether it may write to an argument (in-place, out=)
        self.writes = facts.writes
        #: slots whose last use is this node: dropped after it runs
        self.release: tuple[int, ...] = ()
        #: the op's validator (it may read data: run before the node on every replay), or None
        self.validator = facts.validator


def _callable(ex: Executor, op: torch._ops.OpOverload, label: str, kernel: Any,
              device_index: int) -> tuple[Any, bool, torch._C.DispatchKey | None]:
    """What a node runs, bound once: (callable, whether a missing kernel falls back to a decomposition, the
    composite kernel it calls or None)."""
    if label in GENERATORLESS:
        run = GENERATORLESS[label]
        g = ex.generators.get(device_index, 0)  # the session's default: one object for the session's life
        return (lambda *args, **kwargs: run(g, list(args), kwargs)), False, None
    if kernel is not None:
        return functools.partial(op._op_dk, kernel), False, kernel
    return op._op, True, None  # what OpOverload.__call__ runs, without its frame


class Graph:
    """A session's validated graph on one device."""

    def __init__(self, graph_id: int, device_index: int, inputs: int, nodes: list[_Node], outputs: list[Ref | None]):
        self.graph_id = graph_id
        self.device_index = device_index
        self.inputs = inputs
        self.nodes = nodes
        self.outputs = outputs
        #: whether a node may change a storage's size: only then does a replay look for storages that grew
        self.resizes = any(node.resizes for node in nodes)
        #: whether a node may write to its arguments (an input's data may change between the nodes)
        self.writes = any(node.writes for node in nodes)
        #: what the checked replay of each input signature found (genie.server.graph_gate)
        self.gates: dict[Any, Gate] = {}
        #: replays, and those of them checked node by node in full (books for tests and tools)
        self.replays = 0
        self.checked_runs = 0
        #: the slots the output rule reads after a replay
        self.output_slots = tuple(sorted({ref.slot for ref in outputs if ref is not None}))
        #: admitted replays' nodes in C++ (genie._C_plans.GraphProgram): built on the first, False without it
        self.program: Any = None
        #: empty, or the HoistedChecks that record the validators' calls instead of running them (while
        #: genie.server.cuda_graphs captures the graph: genie.server.replay_checks.recording)
        self.recording: list[HoistedChecks] = []


class SessionGraphs:
    """The graphs one session defined, by id."""

    def __init__(self) -> None:
        self.graphs: dict[int, Graph] = {}
        self.nodes = 0


_sessions: PerSession[SessionGraphs] = PerSession(SessionGraphs)


def session_graphs(executor: Executor) -> SessionGraphs:
    """The graphs of ``executor``'s session (made on first use; dropped with the executor)."""
    return _sessions.get(executor)


# -- definitions ------------------------------------------------------------------------------------


def _has_ref(value: Any) -> bool:
    if type(value) is Ref:
        return True
    if type(value) is list:
        return any(_has_ref(v) for v in value)
    return False


def define(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_GRAPH, req, device, graph_id, definition]``: validate a graph and keep it (genie.server.commands)."""
    if len(cmd) != 5:
        raise FrameError("GRAPH must be [CMD_GRAPH, req, device, graph_id, definition]")
    req, device_index, graph_id, blob = cmd[1], cmd[2], cmd[3], cmd[4]
    if not is_int(graph_id) or not 0 < graph_id <= _MAX_ID:
        raise FrameError(f"a graph id must be an integer from 1 to 2**63-1, got {graph_id!r:.40}")
    label = f"graph {graph_id}"
    error = None
    try:
        ex.begin(device_index)
        definition = decode_definition(blob, DeviceRef, GeneratorRef)
        graphs = session_graphs(ex)
        if graph_id in graphs.graphs:
            raise ProtocolError(f"{label} is already defined in this session; graph ids are never reused")
        if len(graphs.graphs) >= MAX_GRAPHS or graphs.nodes + len(definition.nodes) > MAX_SESSION_NODES:
            raise QuotaExceededError(
                f"session graph limit reached: {len(graphs.graphs)} graphs with {graphs.nodes} nodes (at most "
                f"{MAX_GRAPHS} graphs, {MAX_SESSION_NODES} nodes); recompiling that often means shapes change "
                "every call: mark them dynamic (torch.compile(dynamic=True))")
        graph = _validate(ex, graph_id, device_index, definition)
        graphs.graphs[graph_id] = graph
        graphs.nodes += len(graph.nodes)
    except FrameError:
        raise
    except (GenieError, RuntimeError) as exc:
        error = _error(label, [], _kind_of(exc), _message(exc))
    ex.reply(req, error, None)


def _validate(ex: Executor, graph_id: int, device_index: int, definition: Definition) -> Graph:
    n = definition.inputs
    last_use: dict[int, int] = {}
    nodes: list[_Node] = []
    for i, (name, args, kwargs, *rest) in enumerate(definition.nodes):
        slot = n + i
        where = f"graph {graph_id} node {i}"
        try:
            facts = op_facts(name)
        except ForbiddenOpError as exc:
            raise ForbiddenOpError(f"{where}: {exc}") from None
        op = facts.op
        label = name if isinstance(name, str) else "?"

        def resolved(value: Any, slot: int = slot, i: int = i, where: str = where) -> Any:
            kind = type(value)
            if kind is Ref:
                if value.slot >= slot:
                    raise ProtocolError(f"{where} refers to slot {value.slot}, not an earlier one")
                last_use[value.slot] = i
                return value
            if kind is list:
                return [resolved(v) for v in value]
            if kind is dict:
                return {k: resolved(v) for k, v in value.items()}
            if kind is DeviceRef:
                return ex.device(value.index)
            if kind is GeneratorRef:
                return ex.generators.get(device_index, value.generator_id)
            return value

        node_args, node_kwargs = resolved(args), resolved(kwargs)
        check_device_args(op, f"{where} ({label})", node_args, node_kwargs)
        try:  # dtypes, layouts, pin_memory, split counts: refused now, as the op path refuses them
            preflight.check_arguments(op, label, node_args, node_kwargs)
        except GenieError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        kernel = None
        if rest:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), rest[0]):
                raise ProtocolError(f"{where}: {label} has no {rest[0]} kernel")
            kernel = _DISPATCH_KEYS[rest[0]]
        if facts.generator_arg:  # a None generator is the session's default: bound now, as CMD_OP binds it per op
            ex.generators.fill_default(op, node_args, node_kwargs, device_index)
        call, fallback, kernel = _callable(ex, op, label, kernel, device_index)
        nodes.append(_Node(op, label, node_args, node_kwargs, call, fallback, facts, kernel))
    end = n + len(nodes)
    for ref in definition.outputs:
        if ref is not None and ref.slot >= end:
            raise ProtocolError(f"graph {graph_id} output refers to slot {ref.slot}; the graph has {end} slots")
    kept = {ref.slot for ref in definition.outputs if ref is not None}
    release: dict[int, list[int]] = {}
    for slot, i in last_use.items():
        if slot not in kept:
            release.setdefault(i, []).append(slot)
    for i, slots in release.items():
        nodes[i].release = tuple(slots)
    return Graph(graph_id, device_index, n, nodes, list(definition.outputs))


# -- replays ----------------------------------------------------------------------------------------


def _value(env: list[Any], ref: Ref) -> Any:
    value = env[ref.slot]
    return value if ref.item < 0 else value[ref.item]


def _build(value: Any, env: list[Any]) -> Any:
    if type(value) is Ref:
        return _value(env, value)
    return [_build(v, env) if type(v) in _NESTED else v for v in value]  # only lists hold references


_NESTED = (Ref, list)


def _run_node(node: _Node, args: Any, kwargs: Any, cpu: bool, held: set[int]) -> Any:
    """One node's call after its checks: intra-op threads by the op path's rule (over every input tensor, lists
    too: the same bits on either path), the op (a missing kernel: the op path's decomposition), an empty-family
    result zeroed."""
    if cpu:
        use_serial(serial_size([t.shape for t in tensor_leaves((args, kwargs))]))
    try:
        result = node.call(*args, **kwargs)
    except NotImplementedError:
        if not node.fallback:
            raise
        result = run_op(node.op, args, kwargs)  # a missing kernel: the op path's decomposition
    if node.zero:
        zero_fresh(result, held)
    return result


def _run_nodes(ex: Executor, graph: Graph, env: list[Any], held: set[int], label: str,
               storage_ids: list[int], checked: CheckedReplay | None) -> None:
    """Run the graph's nodes over ``env`` (inputs, then one slot per node); CommandFailed names a failing node.

    ``checked``: each node goes through the full pre-flight (a signature's first replay); else only the
    validators run (the signature's gate admitted the rest), in C++ where the graph has a program."""
    if checked is None:
        program = _program(ex, graph)
        if program and _run_program(program, graph, env, held, label, storage_ids):
            return
    slot = graph.inputs
    cpu = ex.device(graph.device_index).type == "cpu"
    node: _Node | None = None
    args: Any = ()
    kwargs: Any = {}
    try:
        for node in graph.nodes:
            args = node.args
            if node.refs or node.nested:
                args = args.copy()
                for pos, src, item in node.refs:
                    value = env[src]
                    args[pos] = value if item < 0 else value[item]
                for pos, template in node.nested:
                    args[pos] = _build(template, env)
            kwargs = node.kwargs
            if node.kw_refs:
                kwargs = dict(kwargs)
                for key, template in node.kw_refs:
                    kwargs[key] = _build(template, env)
            if checked is not None:
                checked.check(node.op, node.label, args, kwargs)
            elif node.validator is not None:  # it may read data: every replay
                _check_node(graph.recording, slot - graph.inputs, node, args, kwargs)
            env[slot] = result = _run_node(node, args, kwargs, cpu, held)
            if checked is not None:
                checked.ran(node.label, node.resizes, slot, result)
            slot += 1
            for dead in node.release:
                env[dead] = None
                if checked is not None:
                    checked.release(dead)
    except Exception as exc:
        i = slot - graph.inputs
        where = f"{label} node {i} ({node.label})" if node is not None else label
        raise CommandFailed(_error(where, shapes((args, kwargs)), _kind_of(exc), _message(exc),
                                   storage_ids)) from None


def _check_node(recording: list[HoistedChecks], index: int, node: _Node, args: list[Any],
                kwargs: dict[str, Any]) -> None:
    """Node ``index``'s validator on its arguments; recorded instead while its graph is captured as a CUDA graph
    (``recording``: the graph's, see genie.server.replay_checks)."""
    check = node.validator
    assert check is not None
    if recording:
        recording[0].record(index, check, node.label, args, kwargs)
    else:
        check(node.label, args, kwargs)


def _program(ex: Executor, graph: Graph) -> Any:
    """``graph``'s GraphProgram, built on its first admitted replay; False where genie._C_plans is missing (the
    Python loop runs every replay)."""
    if graph.program is None:
        graph.program = False
        if GraphProgram is not None:
            cpu = ex.device(graph.device_index).type == "cpu"
            nodes, recording = graph.nodes, graph.recording

            def python_node(index: int, args: list[Any], kwargs: dict[str, Any], held: set[int]) -> Any:
                node = nodes[index]
                if node.validator is not None:  # it may read data: every replay
                    _check_node(recording, index, node, args, kwargs)
                return _run_node(node, args, kwargs, cpu, held)

            graph.program = GraphProgram([graph_node_spec(n) for n in nodes], graph.inputs, Ref, python_node, cpu)
    return graph.program


def _run_program(program: Any, graph: Graph, env: list[Any], held: set[int], label: str,
                 storage_ids: list[int]) -> bool:
    """An admitted replay's nodes by ``graph``'s program; the output slots in ``env`` afterwards. A failure is the
    Python loop's: CommandFailed naming the node and its arguments' shapes. False, with nothing run, when an input
    is of a kind the program does not hold."""
    try:
        return bool(program.run(env, held, graph.output_slots))
    except Exception as exc:
        i = program.failed_node()
        arguments = program.failed_arguments()
        where = f"{label} node {i} ({graph.nodes[i].label})" if 0 <= i < len(graph.nodes) else label
        raise CommandFailed(_error(where, shapes(arguments) if arguments is not None else [], _kind_of(exc),
                                   _message(exc), storage_ids)) from None


def replay(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_REPLAY, device, graph_id, inputs, outs]``: run a defined graph, its checks and nodes as one op by the
    kernel wrapper (genie.server.kernel: op clock, metrics as ``genie::replay``), its outputs by the output rule."""
    if len(cmd) != 5 or not isinstance(cmd[3], list) or not isinstance(cmd[4], list):
        raise FrameError("REPLAY must be [CMD_REPLAY, device, graph_id, inputs, outs]")
    device_index, graph_id, inputs = cmd[1], cmd[2], cmd[3]
    outs = [o if o is None or type(o) is Descriptor else Descriptor.parse(o, "output descriptor") for o in cmd[4]]
    storage_ids = [o.storage_id for o in outs if o is not None and o.storage_id]
    label = f"graph {graph_id!r:.40}"
    try:
        graph = session_graphs(ex).graphs.get(graph_id) if is_int(graph_id) else None
        try:
            if graph is None:
                raise ProtocolError(f"{label} is not defined in this session; send CMD_GRAPH first")
            if device_index != graph.device_index:
                raise ProtocolError(f"{label} was defined on device {graph.device_index}, not {device_index!r:.20}")
            if len(inputs) != graph.inputs or len(outs) != len(graph.outputs):
                raise ProtocolError(f"{label} takes {graph.inputs} inputs and {len(graph.outputs)} outputs, got "
                                    f"{len(inputs)} and {len(outs)}")
            ex.begin(device_index)
            env = ex.resolve_values(inputs, device_index)
            ex.precheck_outputs(label, storage_ids, outs)
        except (GenieError, IndexError, RuntimeError) as exc:
            raise CommandFailed(_error(label, [], _kind_of(exc), _message(exc), storage_ids)) from None
        used = ex.used_storages()
        key = preflight.signature(env)
        if key is not None and graph.resizes:
            # What a node grows an input by depends on the storage's size too (the pre-flight counts from the
            # smallest storage the input fits): the sizes of the storages, in the order the inputs name them.
            key = (key, tuple(s.nbytes() for s in used.values()))
        gate = graph.gates.get(key) if key is not None else None
        remaining = ex.store.max_bytes - ex.store.bytes_used if ex.store.max_bytes else None
        env.extend([None] * len(graph.nodes))
        held = ex.held_keys()
        graph.replays += 1
        # The whole replay, checks included, is one op's time on the clock; its nodes count as ops.
        ex.kernels.run("genie::replay", _run_gated, (ex, graph, env, held, label, storage_ids, key, gate, remaining,
                                                     used), serial=None, ops=len(graph.nodes),
                       clock_label=f"{label} (replay)")
        results: list[Any] = []
        descs: list[Any] = []
        try:
            for i, (ref, desc) in enumerate(zip(graph.outputs, outs, strict=True)):
                value = None if ref is None else _value(env, ref)
                if desc is not None and value is not None and not isinstance(value, torch.Tensor):
                    raise OutputMismatch(f"output {i} is a {type(value).__name__} here, the client described a tensor")
                if desc is not None or isinstance(value, torch.Tensor):
                    results.append(value)
                    descs.append(desc)
            env.clear()
            # The inputs' storage keys again only where a node may have moved a storage (resize_ reallocates).
            failures = ex.store_results(label, results, descs, ex.held_keys() if graph.resizes else held)
        except OutputMismatch as exc:
            raise CommandFailed(_error(label, [], "mismatch", f"server and client disagree on the output of "
                                       f"{label}: {exc}", storage_ids)) from None
        except (GenieError, IndexError, TypeError) as exc:  # TypeError, IndexError: an item of a non-sequence
            raise CommandFailed(_error(label, [], _kind_of(exc), _message(exc), storage_ids)) from None
    except CommandFailed as failed:
        ex.fail_outputs(failed.record, storage_ids)
        return
    for failure in failures:
        ex.defer(_error(label, [], _kind_of(failure), _message(failure), storage_ids))


def _run_gated(ex: Executor, graph: Graph, env: list[Any], held: set[int], label: str, storage_ids: list[int],
               key: Any, gate: Gate | None, remaining: int | None, used: dict[int, Any]) -> None:
    """A replay's nodes, then what they grew the inputs' storages by counted (a growth past the quota fails the
    replay, whether the nodes ran or not)."""
    try:
        _run_admitted(ex, graph, env, held, label, storage_ids, key, gate, remaining)
    finally:
        grown_past = _account_resizes(ex, used) if graph.resizes else None
    if grown_past is not None:
        raise CommandFailed(_error(label, [], "quota", _message(grown_past), storage_ids))


def _run_admitted(ex: Executor, graph: Graph, env: list[Any], held: set[int], label: str, storage_ids: list[int],
                  key: Any, gate: Gate | None, remaining: int | None) -> None:
    """A replay's nodes: admitted by the gate of their input signature, or each checked in full (which makes
    the signature's gate)."""
    if gate is not None:
        over = gate.over(remaining)
        if over is not None:
            node = graph.nodes[over[0]]
            raise CommandFailed(_error(f"{label} node {over[0]} ({node.label})", [], "quota", _message(
                preflight.over_quota(node.label, over[1], over[2])), storage_ids))
        # issue 33: compiled by inductor where the node was told to (--compile-replays), else a CUDA graph on CUDA
        if not inductor_replays.run(ex, graph, env, held, label, key, storage_ids, _run_nodes):
            try:
                cuda_graphs.run(ex, graph, env, held, label, storage_ids, _run_nodes, gate.grew)
            except HoistedCheckFailed as failed:  # a captured graph's validator, run before its replay, refused
                where = f"{label} node {failed.node} ({graph.nodes[failed.node].label})"
                raise CommandFailed(_error(where, [], _kind_of(failed.error), _message(failed.error),
                                           storage_ids)) from None
        return
    graph.checked_runs += 1
    checked = CheckedReplay(ex, remaining)
    _run_nodes(ex, graph, env, held, label, storage_ids, checked)
    made = checked.gate()
    if key is not None and made is not None:
        if len(graph.gates) >= MAX_GATES:
            graph.gates.clear()
        graph.gates[key] = made


def _account_resizes(ex: Executor, used: dict[Any, Any]) -> QuotaExceededError | None:
    """Count what nodes grew the inputs' storages by; the store's refusal of growth past the quota (it poisons
    that storage), which fails the replay, or None."""
    refused = None
    for _ in range(len(used) + 1):  # each refusal poisons one storage: the next pass counts the others
        try:
            ex.account_resizes(used)
            break
        except QuotaExceededError as exc:
            refused = refused or exc
    return refused

