"""What the native plan runner (genie/csrc/server_plans.cpp) does to the session's store and metrics keeps
them consistent with the Python core's rules (genie.server.store, genie.server.kernel): the byte count
equals the storages' counted sizes after the runner adopts and frees, and its ops are counted in the
session's metrics as Kernels.run counts them. An executor runs in process over a fake channel, so the
runner's own results are read directly.
"""

from __future__ import annotations

import pytest
import torch

from genie.server import plans
from genie.server.executor import Executor
from genie.server.metrics import ServerMetrics
from genie.server.store import StorageStore
from genie.wire.frame import FrameHeader, MsgKind
from tests.raw_client import T, free, op, pack_body
from tests.transport.transport_fakes import FakeChannel

pytestmark = pytest.mark.skipif(plans.Runner is None, reason="genie._C_plans was not built")

X = torch.empty(64, 64)


def _batch(*cmds: bytes) -> tuple[FrameHeader, bytes]:
    body = pack_body({"uploads": [], "cmds": list(cmds)})
    return FrameHeader(MsgKind.BATCH, len(body), 0), body


def _add(a: int, out: int) -> bytes:
    return op("aten::add.Tensor", [T(a, X), T(a, X)], {}, [T(out, X)])


def _executor() -> tuple[Executor, StorageStore]:
    store = StorageStore(max_bytes=1 << 30)
    ex = Executor(FakeChannel("test"), store, [torch.device("cpu")])
    store.put(1, torch.rand(64, 64).untyped_storage())
    ex.run_batch(*_batch(_add(1, 2)))  # the full path makes the plan
    return ex, store


def test_bytes_the_runner_adopts_and_frees_are_counted_by_the_store() -> None:
    ex, store = _executor()
    before = store.bytes_used
    ex.run_batch(*_batch(_add(1, 3), _add(1, 4), _add(3, 5)))
    assert ex.native_runs == 3 and not ex.deferred
    assert store.bytes_used == before + 3 * X.nbytes == sum(store.tables.sizes.values())
    ex.run_batch(*_batch(free(3, 4)))  # small storages: the runner frees them itself
    assert store.bytes_used == before + X.nbytes == sum(store.tables.sizes.values())
    assert 3 not in store and 5 in store and store.seen(3)


def test_ops_the_runner_runs_are_counted_in_the_bound_session_metrics() -> None:
    ex, _ = _executor()
    server = ServerMetrics(devices=["cpu"])
    ex.metrics = server.open_session(1, None)  # type: ignore[arg-type]
    ex.run_batch(*_batch(_add(1, 3)))  # a name the session has not counted: the runner calls record_op
    ex.run_batch(*_batch(_add(1, 4), _add(1, 5)))  # counted in place through the OkTally
    assert ex.native_runs == 3
    tally = ex.metrics.tally
    assert tally.ops[("aten::add.Tensor", "ok")] == 3 and tally.latency["ok"].count == 3
    assert tally.latency["ok"].sum > 0
