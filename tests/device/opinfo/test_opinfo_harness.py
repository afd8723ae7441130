"""The OpInfo harness's own guarantees: a hang, a crashing worker or a dying server costs one case,
and the sweep goes on; the CI subset covers every dtype and kind. Real processes throughout."""

from __future__ import annotations

from typing import Any

import opinfo_expected
import pytest
from opinfo_cases import GATE_CI_DTYPES, GATES, SELFTEST, Case, coverage, select

HANG = Case(SELFTEST, "hang", "float32", "forward")
ABORT = Case(SELFTEST, "abort", "float32", "forward")
PROBE = Case(SELFTEST, "pass", "float32", "forward")


def test_a_hanging_case_fails_with_a_timeout_and_the_next_case_runs_on_fresh_processes(opinfo_sweep: Any) -> None:
    pool = opinfo_sweep.pool
    old_server = pool.server
    result = pool.run(HANG, timeout=1.0)
    assert result["status"] == "fail"
    assert "timed out after 1 s" in result["reason"]
    assert not old_server.alive()  # the hung op may still burn a core there: replaced too
    after = pool.run(PROBE, timeout=opinfo_sweep.timeout)
    assert after == {**after, "status": "pass", "samples": 1}
    assert pool.server.alive()


def test_a_crashing_worker_fails_one_case_naming_the_signal(opinfo_sweep: Any) -> None:
    before = opinfo_sweep.pool.restarts["worker"]
    result = opinfo_sweep.pool.run(ABORT, timeout=opinfo_sweep.timeout)
    assert result["status"] == "fail"
    assert "the worker process died (signal SIGABRT)" in result["reason"]
    assert opinfo_sweep.pool.restarts["worker"] == before + 1
    assert opinfo_sweep.pool.run(PROBE, timeout=opinfo_sweep.timeout)["status"] == "pass"


def test_a_dead_server_fails_one_case_and_is_restarted(opinfo_sweep: Any) -> None:
    pool = opinfo_sweep.pool
    before = pool.restarts["server"]
    pool.server.kill()
    result = pool.run(PROBE, timeout=opinfo_sweep.timeout)
    assert result["status"] == "fail"
    assert "the server died during this case" in result["reason"]
    assert pool.run(PROBE, timeout=opinfo_sweep.timeout)["status"] == "pass"
    assert pool.restarts["server"] == before + 1
    assert pool.server.alive()


def test_ci_subset_is_deterministic_and_covers_every_dtype_and_kind(opinfo_sweep: Any) -> None:
    every = opinfo_sweep.all_cases
    ci = select(every, "ci")
    assert ci == select(list(reversed(every)), "ci")
    narrowed = {(c.kind, c.dtype) for c in every if c.dtype not in GATE_CI_DTYPES.get(c.gate, (c.dtype,))}
    assert coverage(every) - narrowed <= coverage(ci) <= coverage(every)
    assert {c.gate for c in ci} == {c.gate for c in every} == set(GATES)
    assert len(ci) < len(every) / 5


def test_update_keeps_unrun_entries_lists_failures_and_drops_passes(tmp_path: Any) -> None:
    a, b, c = (Case(op, "", "float32", "forward") for op in ("a", "b", "c"))
    old = {a.key: "old reason a", b.key: "old reason b"}
    new = opinfo_expected.updated(old, {b: {"status": "pass"}, c: {"status": "fail", "reason": 'Boom: "x"\\y'}})
    assert new == {a.key: "old reason a", c.key: 'Boom: "x"\\y'}
    path = tmp_path / "expected.toml"
    opinfo_expected.save(new, path)
    assert opinfo_expected.load(path) == new


def test_an_entry_without_a_reason_is_refused_naming_the_file(tmp_path: Any) -> None:
    path = tmp_path / "expected.toml"
    path.write_text('failures = [{op = "a", variant = "", dtype = "float32", kind = "forward", reason = ""}]\n')
    with pytest.raises(ValueError, match="has no reason") as raised:
        opinfo_expected.load(path)
    assert str(path) in str(raised.value)
