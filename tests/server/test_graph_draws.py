"""One rule for whether a graph node draws random numbers (genie.server.rng.node_draws), asked by both places
that would freeze a seed: CUDA graph capture (genie.server.cuda_graphs.eligible) and inductor compiles
(genie.server.inductor_replays.check_graph). A CUDA graph registers the session's generators with its capture, so
it keeps out only a node that would draw from another generator (genie.server.rng.draws_outside_session); an
inductor compile keeps out that node too, and a node that takes a Generator (compiled code takes no Generator
constant), and swaps the session's state into the default generator for the rest. Graphs of real OpOverloads built
as CMD_GRAPH builds them, on CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genie.server import cuda_graphs, graphs, inductor_replays
from genie.server.rng import node_draws
from genie.wire.graph import Ref

aten = torch.ops.aten


def _graph(op: torch._ops.OpOverload, args: list[Any], inputs: int) -> graphs.Graph:
    node = graphs._Node(op, op.name(), args, {}, op, True)
    return graphs.Graph(1, 0, inputs, [node], [Ref(inputs)])


def _attention(dropout_p: float) -> graphs.Graph:
    # Tagged nondeterministic_seeded, no generator argument, not a generatorless op a client may name: before,
    # CUDA graph capture let it in (it checked only those two) and froze its dropout's seed.
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    return _graph(op, [Ref(0), Ref(1), Ref(2), dropout_p], 3)


def _inductor_refuses(graph: graphs.Graph) -> str | None:
    try:
        inductor_replays.check_graph(graph)
    except inductor_replays.Ineligible as e:
        return str(e)
    return None


def test_a_seeded_node_without_a_generator_argument_is_kept_out_of_cuda_graphs_and_inductor() -> None:
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert torch.Tag.nondeterministic_seeded in op.tags
    assert not any("Generator" in str(a.type) for a in op._schema.arguments)
    graph = _attention(0.1)
    assert node_draws(op, op.name(), graph.nodes[0].args, {})
    assert cuda_graphs.eligible(graph) is False
    refused = _inductor_refuses(graph)
    assert refused is not None and "draws random numbers" in refused, refused


def test_the_same_node_with_dropout_p_zero_stays_eligible_for_both() -> None:
    graph = _attention(0.0)
    assert cuda_graphs.eligible(graph) is True
    assert _inductor_refuses(graph) is None


@pytest.mark.parametrize(("op", "args", "kwargs", "inputs", "refused"), [
    # a generator argument: the session's generator, bound at definition (a CUDA graph registers it; inductor's
    # code takes no Generator constant)
    (aten.bernoulli.p, [Ref(0), 0.5], {"generator": torch.Generator()}, 1, {"inductor": "a Generator argument"}),
    # generatorless, run by the session's runners: both take it (inductor with the session's state swapped in)
    (aten.dropout.default, [Ref(0), 0.5, True], {}, 1, {}),
    (aten.native_dropout.default, [Ref(0), 0.5, True], {}, 1, {}),
    # tagged nondeterministic_seeded, no generator argument, no session runner: neither
    (aten.lstm.input, [Ref(0), [Ref(1)], [Ref(2), Ref(3)], True, 1, 0.5, True, False, False], {}, 4,
     {"inductor": "draws random numbers from a generator other than the session's", "cuda": ""}),
])
def test_drawing_nodes_are_taken_where_they_draw_from_the_session(
        op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any], inputs: int, refused: dict[str, str]) -> None:
    node = graphs._Node(op, op.name(), args, kwargs, op, True)
    graph = graphs.Graph(1, 0, inputs, [node], [Ref(inputs)])
    assert node_draws(op, op.name(), args, kwargs)
    assert cuda_graphs.eligible(graph) is ("cuda" not in refused)
    why = _inductor_refuses(graph)
    if "inductor" in refused:
        assert why is not None and refused["inductor"] in why, why
    else:
        assert why is None, why


def test_a_node_that_draws_nothing_is_eligible_for_both() -> None:
    graph = _graph(aten.add.Tensor, [Ref(0), Ref(1)], 2)
    assert cuda_graphs.eligible(graph) is True
    assert _inductor_refuses(graph) is None
