"""No test waits by sleeping: a sleep left in a test says, next to it, why time passing is the behaviour.

A sleep standing in for an event is slow when the event comes early and flaky when it comes
late; tests wait on observable state instead (``genie.testing.wait_until``/``wait_until_async``,
events, reading until a line). The scan is textual so that it also sees the scripts tests hand
to subprocesses.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLEEP = re.compile(r"\b(?:time|anyio|asyncio|trio)\.sleep\(")
MARK = "not a wait"
LOOKBACK = 3  # the mark may sit on a comment line just above the sleep


def scanned_files() -> list[Path]:
    files = [p for p in (ROOT / "tests").rglob("*.py") if "opinfo" not in p.parts]
    return sorted(files + list(ROOT.glob("plugins/*/tests/**/*.py")))


def unmarked_sleeps(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line`` of each sleep with no "not a wait" on its line or the few lines above."""
    lines = path.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if SLEEP.search(line) and not any(MARK in ln.lower() for ln in lines[max(0, i - LOOKBACK):i + 1]):
            found.append(f"{path.relative_to(root)}:{i + 1}: {line.strip()}")
    return found


def test_every_sleep_left_in_the_tests_is_the_behaviour_under_test() -> None:
    files = scanned_files()
    assert ROOT / "tests" / "test_waits.py" in files and len(files) > 50, "the scan must see the test tree"
    offenders = [hit for p in files for hit in unmarked_sleeps(p)]
    assert not offenders, ("sleeps standing in for events: wait on observable state (genie.testing.wait_until), "
                           "or say '# not a wait: <why>' where time passing is the behaviour:\n"
                           + "\n".join(offenders))


def test_the_scan_finds_an_unmarked_sleep(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"  # not a wait: the text below holds a sleep for the scan to find
    probe.write_text("import time\n\n\ndef f():\n    time.sleep(0.1)\n\n\n"
                     "def g():\n    # not a wait: idle past a timeout\n    time.sleep(1)\n")
    assert unmarked_sleeps(probe, tmp_path) == ["test_probe.py:5: time.sleep(0.1)"]
