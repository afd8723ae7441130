"""Output rules of the pre-flight for ops without a meta kernel whose outputs their inputs do not bound
(genie.server.sizerules): each matches the CPU kernel, and a real server refuses a huge histogram before
allocating it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genie.server import sizerules
from tests.raw_client import RawClient, T, call, desc

aten = torch.ops.aten
_x2 = torch.randn(7, 3)
CASES: list[tuple[Any, list[Any], dict[str, Any]]] = [
    (aten.histogram.bin_ct, [torch.randn(2, 5), 9], {}),
    (aten.histogram.bin_ct, [torch.randn(5).double()], {"bins": 4, "density": True}),
    (aten.histogram.bin_ct, [torch.randn(5)], {}),  # bins defaults to 100
    (aten.histogram.bin_ct_out, [torch.randn(5), 4], {"hist": torch.empty(0), "bin_edges": torch.empty(2)}),
    (aten.histogramdd.default, [_x2, [2, 3, 4]], {}),
    (aten.histogramdd.int_bins, [_x2, 5], {}),
    (aten.histogramdd.TensorList_bins, [_x2, [torch.linspace(-3, 3, 4), torch.linspace(-3, 3, 5),
                                             torch.linspace(-3, 3, 2)]], {}),
    # what histogramdd sends from a client (its composite runs there)
    (aten._histogramdd_bin_edges.default, [_x2, [2, 3, 4]], {}),
    (aten._histogramdd_from_bin_cts.default, [_x2, [2, 3, 4]], {}),
    (aten._histogramdd_from_bin_tensors.default, [_x2, [torch.linspace(-3, 3, 4), torch.linspace(-3, 3, 5),
                                                         torch.linspace(-3, 3, 2)]], {}),
]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, list):
        return [_to_meta(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _layouts(result: Any) -> list[tuple[Any, ...]]:
    flat = []
    for t in result if isinstance(result, (list, tuple)) else [result]:
        for u in t if isinstance(t, list) else [t]:
            flat.append((tuple(u.shape), u.dtype))
    return flat


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_rule_gives_the_cpu_kernels_output_shapes_and_dtypes(case: int) -> None:
    op, args, kwargs = CASES[case]
    expected = op(*args, **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    got = sizerules.run(op, _to_meta(args), _to_meta(kwargs))
    assert _layouts(got) == _layouts(expected)
    got = got if isinstance(got, (list, tuple)) else [got]
    assert all(t.device.type == "meta" for t, *_ in [(u,) for r in got for u in (r if isinstance(r, list) else [r])])


@pytest.mark.parametrize(("op", "args", "message"), [
    (aten.histogram.bin_ct, [torch.randn(5), 0], "bins must be > 0"),
    (aten.histogramdd.default, [_x2, [2, 3]], "innermost dimension"),
    (aten.histogramdd.int_bins, [torch.randn(7), 3], "at least 2 dimensions"),
])
def test_arguments_the_kernel_refuses_are_refused_by_the_rule_too(op: Any, args: list[Any], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        op(*args)
    with pytest.raises(RuntimeError, match=message):
        sizerules.run(op, _to_meta(args), {})


def test_a_histogram_of_2_31_bins_is_refused_before_allocating_and_the_session_goes_on(inproc_server) -> None:
    """Before the rule the server allocated the histogram first (no meta kernel: nothing was checked before)."""
    server = inproc_server(max_session_bytes=1 << 20)
    x = torch.randn(10)
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([], uploads=[(1, 0, x)])
        r = c.request([call(c.next_req(), "aten::histogram.bin_ct", [T(1, x), 1 << 24], {}, [2, 3])])
        assert r.error is not None and r.error["kind"] == "quota" and "refused before running" in r.error["message"]
        r = c.request([call(c.next_req(), "aten::histogram.bin_ct", [T(1, x), 1 << 31], {}, [2, 3])])
        assert r.error is not None and r.error["kind"] == "forbidden" and "max_op_elements" in r.error["message"]
        r = c.request([call(c.next_req(), "aten::histogramdd", [T(4, _x2), [1 << 16] * 3], {}, [5, 6, 7, 8, 9])],
                      uploads=[(4, 0, _x2)])
        assert r.error is not None and r.error["kind"] in ("quota", "forbidden"), r.error
        r = c.request([call(c.next_req(), "aten::histogram.bin_ct", [T(1, x), 6], {}, [2, 3])])
        assert r.error is None
        hist, edges = torch.histogram(x, 6)
        assert r.result[0] == desc(2, hist) and r.result[1] == desc(3, edges)
        assert torch.equal(c.fetch(r.result[0]), hist) and torch.equal(c.fetch(r.result[1]), edges)
        assert server.stats()["bytes"] < 1 << 20
