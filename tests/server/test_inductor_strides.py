"""The graph inductor compiles on the node keeps the strides eager kernels give (genie.server.inductor_replays.decompose).

A replayed graph was recorded by the client with eager kernels, so a ``view`` in it assumes eager strides. The
re-trace with inductor's decompositions must not change them: its ``cat`` of one non-empty tensor is a ``clone``,
which keeps a transposed input's strides where ATen's ``cat`` makes a contiguous tensor (a GPT-2 forward with an
empty KV cache failed so on a CPU node: "Cannot view a tensor with shape [2, 2, 32, 64] and strides (4096, 32, 1,
64)"). Only the re-trace runs here (fake tensors, then the decomposed graph on real ones): no inductor compile.
"""

from __future__ import annotations

import torch

from genie.server.inductor_replays import decompose

aten = torch.ops.aten


def _attention_scores_graph() -> torch.fx.GraphModule:
    """``cat`` of an empty cache and a transposed key, then the math attention's ``view`` of the scaled key."""
    g = torch.fx.Graph()
    cache, key = g.placeholder("cache"), g.placeholder("key")  # [2, 2, 0, 32], [2, 64, 2, 32]
    keys = g.call_function(aten.cat.default, ([cache, g.call_function(aten.transpose.int, (key, 1, 2))], -2))
    scaled = g.call_function(aten.mul.Scalar, (g.call_function(aten.transpose.int, (keys, -2, -1)), 0.5))
    flat = g.call_function(aten.view.default, (g.call_function(aten.expand.default, (scaled, [2, 2, 32, 64])),
                                               [4, 32, 64]))
    g.output([flat, keys])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_the_decomposed_graph_keeps_eager_strides_where_a_view_needs_them() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache, key = torch.empty(2, 2, 0, 32), torch.randn(2, 64, 2, 32)
    gm = _attention_scores_graph()
    want_flat, want_keys = gm(cache, key)
    mode = FakeTensorMode()
    with torch.no_grad():
        decomposed = decompose(gm, [mode.from_tensor(cache), mode.from_tensor(key)])
    flat, keys = decomposed(cache, key)
    torch.testing.assert_close(flat, want_flat, rtol=0, atol=0)
    assert keys.stride() == want_keys.stride() == (4096, 2048, 32, 1)  # the graph's output as eager made it
    torch.testing.assert_close(keys, want_keys, rtol=0, atol=0)


def test_nodes_whose_decomposition_keeps_eager_strides_get_no_copy() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output([g.call_function(aten.view.default, (g.call_function(aten.mul.Scalar, (x, 2.0)), [16]))])
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with torch.no_grad():
        decomposed = decompose(gm, [mode.from_tensor(torch.randn(4, 4))])
    targets = [n.target for n in decomposed.graph.nodes if n.op == "call_function"]
    assert aten.empty_strided.default not in targets and aten.copy_.default not in targets, targets
