"""genie.compile.reinplace: functional foreach ops of a compiled optimizer step written in place (issue 16).

Pure graph tests on the local CPU (the pass runs on the client before a graph is shipped); the replayed
steps on a real server are compared with op-by-op ones in test_compile_optimizers.py.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd

from genie.compile.reinplace import reinplace_foreach

aten = torch.ops.aten


def _graph(read_after: bool) -> fx.GraphModule:
    """``r = _foreach_mul([a, b], 2)``, epilogue copies of r into a and b, and optionally ``a + 1`` read after."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    early = g.call_function(aten.add.Tensor, (a, 1))
    r = g.call_function(aten._foreach_mul.Scalar, ([a, b], 2.0))
    r0, r1 = g.call_function(operator.getitem, (r, 0)), g.call_function(operator.getitem, (r, 1))
    late = g.call_function(aten.add.Tensor, (a, 1)) if read_after else early
    g.call_function(aten.copy_.default, (a, r0))
    g.call_function(aten.copy_.default, (b, r1))
    g.output((late, early))
    return fx.GraphModule(torch.nn.Module(), g)


def _run(gm: fx.GraphModule) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    a, b = torch.arange(3.0), torch.arange(3.0) + 10
    out = gm(a, b)
    return [a, b], out


def test_a_foreach_op_whose_results_go_back_into_its_inputs_runs_in_place() -> None:
    gm = _graph(read_after=False)
    expected = _run(_graph(read_after=False))
    assert reinplace_foreach(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten._foreach_mul_.Scalar in targets and aten._foreach_mul.Scalar not in targets
    assert aten.copy_.default not in targets  # copy_(a, a) dropped
    got = _run(gm)
    assert all(torch.equal(x, y) for x, y in zip(got[0], expected[0], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(got[1], expected[1], strict=True))


def test_an_input_read_after_the_op_is_left_alone() -> None:
    gm = _graph(read_after=True)
    assert reinplace_foreach(gm) == 0  # a + 1 after the op needs a's old value
    assert aten._foreach_mul.Scalar in [n.target for n in gm.graph.nodes]


def test_an_input_the_graph_does_not_overwrite_is_never_written() -> None:
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    r = g.call_function(aten._foreach_mul.Scalar, ([a, b], 2.0))
    g.output((g.call_function(operator.getitem, (r, 0)), g.call_function(operator.getitem, (r, 1))))
    assert reinplace_foreach(fx.GraphModule(torch.nn.Module(), g)) == 0


def _adamw_params(rewrite: bool) -> tuple[list[torch.Tensor], int]:
    counts: list[int] = []

    def compiler(gm: fx.GraphModule, _inputs: list[torch.Tensor]) -> object:
        counts.append(reinplace_foreach(gm) if rewrite else 0)
        if rewrite:
            assert aten.copy_.default not in [n.target for n in gm.graph.nodes]
        return gm.forward

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    step = torch.compile(opt.step, backend=backend)
    torch.manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        step()
    torch._dynamo.reset()
    return [p.detach().clone() for p in model.parameters()], sum(counts)


def test_a_compiled_adamw_step_reinplaced_is_bit_identical_and_copies_nothing_back() -> None:
    """Its state (exp_avg, exp_avg_sq, params) is updated in place; sqrt of exp_avg_sq is not (a reader of
    the final value: the epilogue copy), which an earlier draft got wrong (NaN parameters)."""
    plain, _ = _adamw_params(rewrite=False)
    rewritten, count = _adamw_params(rewrite=True)
    assert count >= 4
    assert all(torch.equal(x, y) for x, y in zip(plain, rewritten, strict=True))
