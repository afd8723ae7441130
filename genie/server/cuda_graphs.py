"""Replayed graphs as CUDA graphs on a CUDA server (hardware-only: exercised by ``scripts/gpu-check``).

A graph a client replays (``torch.accelerator.Graph`` captures, ``torch.compile(backend="genie")``
graphs: :mod:`genie.server.graphs`) runs its nodes one kernel launch at a time, each through Python.
On a CUDA device, once a replay's input signature has its gate (the second replay of that
signature: the first is checked node by node and warms the kernels up), the nodes are captured
once into a ``torch.cuda.CUDAGraph`` and later replays launch that graph alone, as a local
``torch.cuda.graphs`` user would.

A CUDA graph keeps the addresses it was captured with, so a replay uses it only when every input
tensor has the same shape, strides and dtype (and every number the same value) as at capture, and the
same data pointer, or else is copied in. An input found at a new address when its graph is replayed
again (a ``torch.compile`` backward's saved activations are new storages every step; its parameters
stay) is from then on copied, before each replay, into a buffer of its own that the graph was captured
over (a device-to-device copy; back into the input after the replay where a node writes to its
arguments), as inductor's CUDA graph trees copy their inputs that are not static; an input that is not
dense (an expanded view) cannot have such a buffer, and a graph whose inputs move otherwise is
captured again, at most :data:`MAX_CAPTURES` times, then stays eager. The buffers are outside the
session's byte quota, like the private pool. The outputs live in the CUDA graph's private pool: the
replay's output rule copies them into the client's storages (they are marked held, never adopted).

A node that reads data in its validator (the embedding backward's indices) cannot run under a capture, and a
replay runs no Python: the capture records each validator's call instead (:mod:`genie.server.replay_checks`), and
the recorded calls run before the first replay and every later one, on that replay's inputs. A graph whose
validator reads data the graph itself computes, or replaces an argument, stays eager (checked once, right after
its capture). Random numbers come from the session's generators (a dropout node's mask): each generator of the
session on the graph's device is registered with the capture (``CUDAGraph.register_generator_state``), so every
replay draws new numbers, from the generator's state at that replay, as the same nodes run one by one would. A
node that would draw from another generator (an op tagged ``nondeterministic_seeded`` that neither takes a
generator argument nor runs by a session-bound runner: :func:`genie.server.rng.draws_outside_session`) keeps
its graph eager. A signature whose checked replay grew an input's storage (a
``resize_``, ``set_`` or ``out=`` into a storage too small: it would be reallocated, and a CUDA graph
keeps the old address) runs node by node (``Gate.grew``); ``out=`` nodes writing into storages of the
right size, as every op of a ``torch.accelerator.Graph`` capture does, no longer keep a graph eager.
A capture that fails (a kernel that cannot be captured) leaves that graph eager for good, logged
once. The private pool's memory is the CUDA graph's, outside the session's byte quota (like the
CUDA context itself); it is released with the graph, and a session keeps at most
:data:`MAX_CUDA_GRAPHS` of them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from genie.server.replay_checks import HoistedChecks, NotHoistable, recording
from genie.server.rng import draws_outside_session
from genie.server.validators import dense

log = logging.getLogger("genie.server.cuda_graphs")

#: Captures one graph may need (its input addresses changed) before it stays eager.
MAX_CAPTURES = 3
#: CUDA graphs one session worker keeps at most: each holds its intermediates in a private pool outside the
#: session's byte quota, so their number is bounded; later graphs run node by node.
MAX_CUDA_GRAPHS = 8


class CudaGraph:
    """One ``torch.cuda.CUDAGraph``, the session's generators of its device registered with it."""

    def __init__(self, ex: Any, graph: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        for generator in ex.generators.on_device(graph.device_index):  # a replay draws from their state then
            self.graph.register_generator_state(generator)

    def capture(self, nodes: Callable[[list[Any]], None], env: list[Any]) -> None:
        """Record the kernels ``nodes(env)`` launches over the replay environment ``env`` (none runs); the results
        it leaves in ``env`` are where every replay writes."""
        try:
            with torch.cuda.graph(self.graph):
                nodes(env)
        except Exception:
            torch.cuda.synchronize()  # the failed capture's stream state settled before the nodes run eagerly
            raise

    def replay(self, env: list[Any]) -> None:
        """Launch the recorded kernels (over the capture's addresses: ``env``, the replay's, has the same)."""
        self.graph.replay()


#: How a graph is captured, by device type (tests on a host without a GPU add a CPU stand-in).
CAPTURES: dict[str, Callable[[Any, Any], Any]] = {"cuda": CudaGraph}


class _Captured:
    __slots__ = ("addresses", "buffers", "captured", "captures", "checks", "copied", "cuda_graph", "failed",
                 "signature")

    def __init__(self) -> None:
        #: each input's data pointer at the last capture (None: not a tensor)
        self.addresses: tuple[int | None, ...] = ()
        #: the input slots copied in before each replay, and the buffers the capture read them from
        self.copied: frozenset[int] = frozenset()
        self.buffers: dict[int, torch.Tensor] = {}
        self.cuda_graph: Any = None
        #: the validators' calls recorded by the capture, run before each replay
        self.checks: HoistedChecks | None = None
        self.signature: tuple[Any, ...] | None = None
        #: the capture's environment: its output slots hold the graph's outputs (its inputs' are cleared)
        self.captured: list[Any] = []
        self.captures = 0
        self.failed = False


_states: weakref.WeakKeyDictionary[Any, _Captured] = weakref.WeakKeyDictionary()


def eligible(graph: Any) -> bool:
    """Whether ``graph`` (a :class:`genie.server.graphs.Graph`) may become a CUDA graph: no node that would draw from a
    generator other than the session's. (Whether its validators can run ahead of it is found at its capture;
    whether a signature's replay grows an input's storage is its gate's: ``Gate.grew``, which :func:`run` asks.)"""
    return not any(draws_outside_session(node.op, node.label, node.args, node.kwargs) for node in graph.nodes)


def _signature(values: list[Any], copied: frozenset[int] = frozenset()) -> tuple[Any, ...]:
    """What a captured graph's inputs must match: every tensor's address (but those ``copied`` in), shape, strides,
    dtype and device; every other value itself."""
    out: list[Any] = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            out.append((None if i in copied else v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device))
        elif isinstance(v, (list, tuple)):
            out.append(_signature(list(v)))
        else:
            out.append((type(v), v))
    return tuple(out)


def run(ex: Any, graph: Any, env: list[Any], held: set[int], label: str, storage_ids: list[int],
        run_nodes: Callable[..., None], grew: bool = False) -> None:
    """Run an admitted replay's nodes: ``run_nodes(ex, graph, env, held, label, storage_ids, None)`` as it is, or
    as a CUDA graph on a CUDA device (captured on first use, see the module's docstring). ``grew``: the signature's
    checked replay grew an input's storage (its gate's ``grew``): such a replay runs node by node."""
    kind = CAPTURES.get(ex.device(graph.device_index).type)
    if kind is None or grew:
        run_nodes(ex, graph, env, held, label, storage_ids, None)
        return
    state = _states.get(graph)
    if state is None:
        state = _states[graph] = _Captured()
        state.failed = not eligible(graph)
    if state.failed:
        run_nodes(ex, graph, env, held, label, storage_ids, None)
        return
    signature = _signature(env[:graph.inputs], state.copied)
    if state.cuda_graph is not None and state.signature != signature:
        moved = _moved(state, env[:graph.inputs])
        if moved:  # copied in from now on: the graph is captured again over buffers for them
            state.copied |= moved
            signature = _signature(env[:graph.inputs], state.copied)
    if state.cuda_graph is None or state.signature != signature:
        if state.captures >= MAX_CAPTURES:
            state.failed = True
            state.cuda_graph, state.captured, state.buffers = None, [], {}
            log.info("%s: its inputs moved %d times; it stays eager", label, MAX_CAPTURES)
            run_nodes(ex, graph, env, held, label, storage_ids, None)
            return
        if not _capture(kind, ex, graph, env, held, label, storage_ids, run_nodes, state, signature):
            run_nodes(ex, graph, env, held, label, storage_ids, None)
            return
    elif state.checks:
        state.checks.run(env)  # HoistedCheckFailed: the replay is refused before anything ran
    for slot, buffer in state.buffers.items():
        buffer.copy_(env[slot])
    state.cuda_graph.replay(env)
    if graph.writes:
        for slot, buffer in state.buffers.items():
            env[slot].copy_(buffer)  # what a node wrote to that input
    for slot in graph.output_slots:
        if slot < graph.inputs:
            continue  # an input given back: the replay's own
        env[slot] = value = state.captured[slot]
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor):
                held.add(t.untyped_storage().data_ptr())  # the graph's pool: copied out, never adopted


def _capture(kind: Callable[[Any, Any], Any], ex: Any, graph: Any, env: list[Any], held: set[int], label: str,
             storage_ids: list[int], run_nodes: Callable[..., None], state: _Captured,
             signature: tuple[Any, ...]) -> bool:
    if state.cuda_graph is None and sum(s.cuda_graph is not None for s in _states.values()) >= MAX_CUDA_GRAPHS:
        state.failed = True
        log.info("%s stays eager: this session keeps %d CUDA graphs already", label, MAX_CUDA_GRAPHS)
        return False
    state.captures += 1
    captured = list(env)
    buffers = {slot: torch.empty_strided(env[slot].shape, env[slot].stride(), dtype=env[slot].dtype,
                                         device=env[slot].device) for slot in sorted(state.copied)}
    for slot, buffer in buffers.items():
        captured[slot] = buffer.copy_(env[slot])  # before the capture: what a capture reads is never garbage
    try:
        cuda_graph = kind(ex, graph)
        # An input a node may write to may change before a later node's check reads it: recorded as a fake tensor
        # too, so only checks that read none of its data run ahead (replay_checks.shown).
        with recording(graph, captured[:graph.inputs]) as checks:
            cuda_graph.capture(lambda e: run_nodes(ex, graph, e, held, label, storage_ids, None), captured)
    except Exception as exc:  # a node that cannot be captured: eager from now on
        state.failed, state.cuda_graph, state.captured, state.buffers = True, None, [], {}
        log.warning("%s cannot be captured as a CUDA graph (%s); it runs node by node", label, exc)
        return False
    try:
        checks.verify(env)  # its validators, before this first replay; can they run ahead of every replay?
    except NotHoistable as exc:
        state.failed, state.cuda_graph, state.captured, state.buffers = True, None, [], {}
        log.info("%s stays eager: %s", label, exc)
        return False
    state.addresses = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else None for v in env[:graph.inputs])
    captured[:graph.inputs] = [None] * graph.inputs  # the graph keeps their addresses, not the storages
    state.cuda_graph, state.signature, state.checks, state.captured = cuda_graph, signature, checks, captured
    state.buffers = buffers
    log.info("%s: captured as a CUDA graph (capture %d of %d nodes; %d inputs copied in, %d checks before each "
             "replay)", label, state.captures, len(graph.nodes), len(buffers), len(checks))
    return True


def _moved(state: _Captured, inputs: list[Any]) -> frozenset[int]:
    """The tensor inputs at another address than at the last capture, where every one of them can be copied into a
    buffer of its own (dense, the shape, strides and dtype of the capture); else none."""
    moved = []
    for slot, (v, address) in enumerate(zip(inputs, state.addresses, strict=True)):
        if isinstance(v, torch.Tensor) and address is not None and v.data_ptr() != address:
            if not dense(v) or state.signature is None or _signature([v])[0][1:] != state.signature[slot][1:]:
                return frozenset()
            moved.append(slot)
    return frozenset(moved)


def stats(graph: Any) -> dict[str, Any]:
    """How ``graph`` runs on this server (for tests and tools): captures made, whether it stays eager."""
    state = _states.get(graph)
    if state is None:
        return {"captures": 0, "eager": False, "captured": False}
    return {"captures": state.captures, "eager": state.failed, "captured": state.cuda_graph is not None}
