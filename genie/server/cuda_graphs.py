"""Replayed graphs as CUDA graphs on a CUDA server (hardware-only: exercised by ``scripts/gpu-check``).

A graph a client replays (``torch.accelerator.Graph`` captures, ``torch.compile(backend="genie")``
graphs: :mod:`genie.server.graphs`) runs its nodes one kernel launch at a time, each through Python.
On a CUDA device, once a replay's input signature has its gate (the second replay of that
signature: the first is checked node by node and warms the kernels up), the nodes are captured
once into a ``torch.cuda.CUDAGraph`` and later replays launch that graph alone, as a local
``torch.cuda.graphs`` user would.

A CUDA graph keeps the addresses it was captured with, so a replay uses it only when every input
tensor has the same data pointer, shape, strides and dtype (and every number the same value) as
at capture; otherwise the nodes run as before and the graph is captured again, at most
:data:`MAX_CAPTURES` times per graph (a ``torch.compile`` graph whose inputs are new storages every
call stays eager). The outputs live in the CUDA graph's private pool: the replay's output rule copies
them into the client's storages (they are marked held, never adopted).

Graphs stay eager where a CUDA graph would change what is checked or computed: a node whose
validator reads data (it must run before every replay), a node that draws random numbers (the
session's generators are not registered with the capture; :func:`genie.server.rng.node_draws`, the
rule inductor replays use too). A signature whose checked replay grew an input's storage (a
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

from genie.server.rng import node_draws

log = logging.getLogger("genie.server.cuda_graphs")

#: Captures one graph may need (its input addresses changed) before it stays eager.
MAX_CAPTURES = 3
#: CUDA graphs one session worker keeps at most: each holds its intermediates in a private pool outside the
#: session's byte quota, so their number is bounded; later graphs run node by node.
MAX_CUDA_GRAPHS = 8


class _Captured:
    __slots__ = ("captures", "cuda_graph", "failed", "outputs", "signature")

    def __init__(self) -> None:
        self.cuda_graph: Any = None
        self.signature: tuple[Any, ...] | None = None
        self.outputs: dict[int, Any] = {}
        self.captures = 0
        self.failed = False


_states: weakref.WeakKeyDictionary[Any, _Captured] = weakref.WeakKeyDictionary()


def eligible(graph: Any) -> bool:
    """Whether ``graph`` (a :class:`genie.server.graphs.Graph`) may become a CUDA graph: no node that reads data in
    a validator or draws random numbers. (Whether a signature's replay grows an input's storage is its gate's:
    ``Gate.grew``, which :func:`run` asks.)"""
    for node in graph.nodes:
        if node.validator is not None or node_draws(node.op, node.label, node.args, node.kwargs):
            return False
    return True


def _signature(values: list[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append((v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device))
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
    device = ex.device(graph.device_index)
    if device.type != "cuda" or grew:
        run_nodes(ex, graph, env, held, label, storage_ids, None)
        return
    state = _states.get(graph)
    if state is None:
        state = _states[graph] = _Captured()
        state.failed = not eligible(graph)
    if state.failed:
        run_nodes(ex, graph, env, held, label, storage_ids, None)
        return
    signature = _signature(env[:graph.inputs])
    if state.cuda_graph is None or state.signature != signature:
        if state.captures >= MAX_CAPTURES:
            state.failed = True
            state.cuda_graph, state.outputs = None, {}
            log.info("%s: its inputs moved %d times; it stays eager", label, MAX_CAPTURES)
            run_nodes(ex, graph, env, held, label, storage_ids, None)
            return
        if not _capture(ex, graph, env, held, label, storage_ids, run_nodes, state, signature):
            run_nodes(ex, graph, env, held, label, storage_ids, None)
            return
    state.cuda_graph.replay()
    for slot, value in state.outputs.items():
        env[slot] = value
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor):
                held.add(t.untyped_storage().data_ptr())  # the graph's pool: copied out, never adopted


def _capture(ex: Any, graph: Any, env: list[Any], held: set[int], label: str, storage_ids: list[int],
             run_nodes: Callable[..., None], state: _Captured, signature: tuple[Any, ...]) -> bool:
    if state.cuda_graph is None and sum(s.cuda_graph is not None for s in _states.values()) >= MAX_CUDA_GRAPHS:
        state.failed = True
        log.info("%s stays eager: this session keeps %d CUDA graphs already", label, MAX_CUDA_GRAPHS)
        return False
    state.captures += 1
    captured = list(env)
    cuda_graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(cuda_graph):
            run_nodes(ex, graph, captured, held, label, storage_ids, None)
    except Exception as exc:  # a node that cannot be captured: eager from now on
        state.failed = True
        log.warning("%s cannot be captured as a CUDA graph (%s); it runs node by node", label, exc)
        torch.cuda.synchronize(ex.device(graph.device_index))
        return False
    state.cuda_graph, state.signature = cuda_graph, signature
    state.outputs = {ref.slot: captured[ref.slot] for ref in graph.outputs if ref is not None}
    return True


def stats(graph: Any) -> dict[str, Any]:
    """How ``graph`` runs on this server (for tests and tools): captures made, whether it stays eager."""
    state = _states.get(graph)
    if state is None:
        return {"captures": 0, "eager": False, "captured": False}
    return {"captures": state.captures, "eager": state.failed, "captured": state.cuda_graph is not None}
