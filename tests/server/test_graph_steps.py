"""How genie.server.graphs compiles a validated node for replays: which ops may resize a storage, and
where references are filled in (pure functions on real OpOverloads; replays themselves are tested
against a real server in tests/device/test_compile.py)."""

from __future__ import annotations

import pytest
import torch

from genie.server import graphs
from genie.wire.graph import Ref

aten = torch.ops.aten


@pytest.mark.parametrize(("op", "resizes"), [
    (aten.resize_.default, True),
    (aten.set_.source_Storage, True),
    (aten.mm.out, True),             # out= resizes its output
    (aten.add_.Tensor, False),       # in place: never changes its sizes
    (aten.copy_.default, False),
    (aten._fused_adamw_.default, False),
    (aten.add.Tensor, False),        # functional
])
def test_only_resize_set_and_out_ops_may_resize_a_storage(op: torch._ops.OpOverload, resizes: bool) -> None:
    assert graphs._may_resize(op) is resizes


def test_a_node_records_top_level_nested_and_keyword_references() -> None:
    args = [Ref(0), 2, [Ref(1), Ref(2, 0)]]
    kwargs = {"alpha": 1, "other": [Ref(3)]}
    node = graphs._Node(aten.add.Tensor, "aten::add.Tensor", args, kwargs, aten.add.Tensor._op, True)
    assert node.refs == ((0, 0, -1),)
    assert node.nested == ((2, args[2]),)
    assert node.kw_refs == (("other", [Ref(3)]),)
    assert node.zero is False and node.resizes is False and node.release == ()
    empty = graphs._Node(aten.empty_strided.default, "aten::empty_strided", [[2], [1]], {}, None, True)
    assert empty.zero is True and empty.refs == () and empty.nested == ()


def test_building_a_nested_argument_takes_items_of_multi_output_slots() -> None:
    pair = (torch.ones(1), torch.full((1,), 2.0))
    env: list[object] = [torch.zeros(1), pair]
    built = graphs._build([Ref(0), Ref(1, 1)], env)
    assert built[0] is env[0] and built[1] is pair[1]
