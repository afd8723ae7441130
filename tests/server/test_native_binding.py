"""What the native plan runner (genie._C_plans) does to the session's store and metrics keeps them consistent
with the Python core's rules (genie.server.store, genie.server.kernel): the byte count equals the storages'
counted sizes after the runner adopts and frees, and its ops are counted in the session's metrics as
Kernels.run counts them. It binds to the core only through genie.server.runner_api: the tuples it reads by
position have the fields the extension was built for, and anything else is refused. An executor runs in
process over a fake channel, so the runner's own results are read directly.
"""

from __future__ import annotations

import pytest
import torch

from genie.server import plans, runner_api
from genie.server.executor import Executor
from genie.server.metrics import Latency, OkTally, ServerMetrics
from genie.server.store import StorageStore, StoreTables
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


def test_the_runner_reads_the_binding_tuples_by_the_fields_it_was_built_for() -> None:
    import genie._C_plans as native

    assert native.SPEC_FIELDS == runner_api.NativeSpec._fields
    assert native.GRAPH_NODE_FIELDS == runner_api.GraphNodeSpec._fields
    assert native.LAYOUT_FIELDS == runner_api.Layout._fields
    assert native.BINDING_FIELDS == runner_api.RunnerBinding._fields
    assert native.TABLES_FIELDS == StoreTables._fields
    assert native.TALLY_FIELDS == OkTally._fields


def test_a_native_plan_is_made_from_its_spec_and_nothing_else() -> None:
    ex, _ = _executor()
    (plan,) = ex.plans.values()
    spec = runner_api.native_spec(plan)
    assert spec.op_name == "aten::add" and spec.overload == "Tensor" and spec.label == "aten::add.Tensor"
    assert spec.inputs == [runner_api.Layout(slot, X.nbytes, 0, (64, 64), (64, 1), torch.float32) for slot in (0, 1)]
    assert spec.outputs == [runner_api.Layout(2, X.nbytes, 0, (64, 64), (64, 1), torch.float32)]
    plans.NativePlan(spec)
    with pytest.raises(RuntimeError, match="NativeSpec"):
        plans.NativePlan(plan)  # the CommandPlan itself: its attributes are not read
    with pytest.raises(RuntimeError, match="Layout"):
        plans.NativePlan(spec._replace(inputs=[(0, X.nbytes)]))  # type: ignore[list-item]


def test_the_runner_refuses_a_binding_it_cannot_use_and_keeps_the_one_it_had() -> None:
    ex, store = _executor()
    assert ex.native is not None
    with pytest.raises(RuntimeError, match="RunnerBinding"):
        ex.native.bind(store)  # the store itself: never read by attribute
    tables = store.tables
    with pytest.raises(RuntimeError, match="StoreTables"):
        ex.native.bind(runner_api.RunnerBinding(tables._replace(freed={}), None))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="OkTally"):
        ex.native.bind(runner_api.RunnerBinding(tables, OkTally({}, Latency(), (0.5,), print)))  # other buckets
    ex.run_batch(*_batch(_add(1, 3)))  # still bound to the store
    assert ex.native_runs == 1 and 3 in store and store.bytes_used == sum(tables.sizes.values())


def test_new_session_metrics_are_bound_to_the_runner_and_the_old_ones_left() -> None:
    ex, _ = _executor()
    server = ServerMetrics(devices=["cpu"])
    first = ex.metrics = server.open_session(1, None)  # type: ignore[arg-type]
    ex.run_batch(*_batch(_add(1, 3), _add(1, 4)))
    second = ex.metrics = server.open_session(2, None)  # type: ignore[arg-type]
    ex.run_batch(*_batch(_add(1, 5)))
    assert ex.native_runs == 3
    assert first.tally.ops[("aten::add.Tensor", "ok")] == 2 and second.tally.ops[("aten::add.Tensor", "ok")] == 1
