"""genie.stats() and genie.profile(): round trips counted, each attributed to the line that caused it."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import genie

pytestmark = pytest.mark.usefixtures("remote")


def _line_of(marker: str) -> int:
    """The line number of ``marker`` in this file (so the test does not hard-code numbers)."""
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line_of" not in line)


def test_profile_counts_queued_ops_round_trips_and_names_the_sync_lines() -> None:
    x = torch.ones(256, device="remote_accelerator:0")
    out = io.StringIO()
    with genie.profile(file=out) as prof:
        for _ in range(3):
            x = x * 2  # fire-and-forget: queued, no round trip
        total = x.sum().item()  # SYNC-A
        back = x.cpu()  # SYNC-B
    assert total == 256 * 8 and back.shape == (256,)
    stats = prof.stats
    assert stats["ops_queued"] >= 4, "three multiplications and a sum are queued"
    assert stats["round_trips"] == 2 and stats["bytes_down"] >= 256 * 4
    lines = {(p["line"], p["count"]) for p in stats["sync_points"]}
    assert lines == {(f"test_stats.py:{_line_of('# SYNC-A')} (test_profile_counts_queued_ops_round_trips_and_names"
                      f"_the_sync_lines)", 1),
                     (f"test_stats.py:{_line_of('# SYNC-B')} (test_profile_counts_queued_ops_round_trips_and_names"
                      f"_the_sync_lines)", 1)}
    assert 0 < stats["wait_seconds"] <= stats["wall_seconds"]
    table = out.getvalue()
    assert table.startswith("genie profile") and "round trips" in table and "top sync points (2 of 2)" in table
    assert f"test_stats.py:{_line_of('# SYNC-A')}" in table


def test_stats_are_cumulative_and_profile_reports_only_its_block(capsys: pytest.CaptureFixture[str]) -> None:
    before = genie.stats()
    x = torch.arange(10, device="remote_accelerator:0")
    for _ in range(5):
        int(x[3].item())  # SYNC-LOOP
    after = genie.stats()
    assert after["round_trips"] - before["round_trips"] == 5
    with genie.profile() as prof:
        pass
    assert prof.stats["round_trips"] == 0 and prof.stats["sync_points"] == []
    assert "no sync points" in capsys.readouterr().out
    (hot,) = [p for p in after["sync_points"] if p["line"].startswith(f"test_stats.py:{_line_of('# SYNC-LOOP')} ")]
    assert hot["count"] == 5  # other tests of this process have sync points of their own


def test_profile_can_stay_quiet() -> None:
    with genie.profile(print_table=False, file=sys.stderr) as prof:
        torch.ones(2, device="remote_accelerator:0").sum().item()
    assert prof.stats["round_trips"] == 1 and "1 x" in prof.table()
