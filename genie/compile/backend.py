"""The dynamo backend: AOTAutograd as ``aot_eager`` runs it, with graph compilers that replay remotely."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
from torch import fx

from genie.compile.lower import Unsupported, lower
from genie.compile.reinplace import reinplace_foreach
from genie.compile.replay import ReplayedGraph
from genie.device import dispatch, registry

log = logging.getLogger("genie.compile")

_names = itertools.count(1)


def compile_model(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """Lower ``gm`` with AOTAutograd (same partitioner and options as ``aot_eager``, so a replayed graph runs
    exactly the ops ``aot_eager`` would run one by one) and compile each aten graph with :func:`compile_graph`."""
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, example_inputs, fw_compiler=compile_graph, bw_compiler=compile_graph, **kwargs)


def _boxed(gm: fx.GraphModule) -> Any:
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """One aten graph (forward, backward or inference) -> a boxed callable that replays it on the server."""
    name = f"graph#{next(_names)}"
    reinplaced = reinplace_foreach(gm)  # a compiled optimizer step's foreach ops write their state in place
    if reinplaced:
        log.debug("%s: %d foreach ops reinplaced", name, reinplaced)
    try:
        lowered = lower(gm)
    except Unsupported as exc:
        log.warning("genie: %s runs op by op: %s", name, exc)
        return _boxed(gm)
    devices = {t.device.index for t in example_inputs
               if isinstance(t, torch.Tensor) and t.device.type == dispatch.BACKEND}
    if not devices:
        log.debug("%s has no remote inputs; it runs as it is", name)
        return _boxed(gm)
    replayed = ReplayedGraph(gm, lowered, name)
    if len(devices) == 1 and registry._table is not None:
        # Define it now: a graph the server refuses (a forbidden op) fails at compile time.
        (index,) = devices
        replayed.graph_id(registry.table().get(index if index is not None else 0))
    return replayed
