"""A graph that draws from the session's generator (dropout), compiled by inductor on the node: the compiled code
draws its seeds from the session's generator state, swapped into the process's default generator around each
compiled run and swapped back (genie.server.inductor_replays._session_draws). Real CMD_GRAPH/CMD_REPLAY through an
in-process executor on CPU (inductor generates C++ and compiles it with the host's gcc)."""

from __future__ import annotations

from typing import Any

import torch

from genie.server import inductor_replays
from genie.testing import wait_until
from genie.wire.graph import Ref
from tests.server.graph_session import Session

N = 4096


def _compiled_session() -> Session:
    nodes: list[list[Any]] = [["aten::native_dropout", [Ref(0), 0.5, True], {}],  # 1: (output, mask)
                              ["aten::mul.Scalar", [Ref(1, 0), 3.0], {}]]       # 2
    s = Session(nodes, [torch.ones(N)], [Ref(2), Ref(1, 1)], [torch.empty(N), torch.empty(N, dtype=torch.bool)],
                program=True)
    inductor_replays.configure(s.ex, "inductor")
    wait_until(lambda: (s.replay(), inductor_replays.stats(s.ex, 7)["compiled"])[1] == 1, timeout=240,
               what="inductor to compile the dropout graph")
    return s


def test_compiled_dropout_draws_from_the_session_seed_and_leaves_the_process_generator_alone() -> None:
    s = _compiled_session()
    process = torch.default_generator.get_state()
    s.seed(1234)
    first = [s.replay() for _ in range(3)]
    s.seed(1234)
    again = [s.replay() for _ in range(3)]
    for a, b in zip(first, again, strict=True):  # the session's seed decides the compiled code's draws
        assert isinstance(a, list) and isinstance(b, list), (a, b)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    masks = [r[1] for r in first if isinstance(r, list)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])  # a new mask each run
    for out, mask in (r for r in first if isinstance(r, list)):
        assert 0.4 < float(mask.float().mean()) < 0.6
        assert torch.equal(out, mask.float() * 6.0)  # kept elements scaled by 1 / (1 - p), then times 3
    assert torch.equal(torch.default_generator.get_state(), process)  # swapped back after every run
    s.seed(99)
    assert not torch.equal(s.replay()[1], first[0][1])  # type: ignore[index]
