"""The OpInfo sweep's pytest wiring: cases as test items, one server and worker per session, the report.

Options (give them with this directory on the command line, ``pytest tests/device/opinfo ...``; the
environment variables work from anywhere):

- ``GENIE_OPINFO=ci|full``: the CI subset (default) or every case.
- ``--update-expected`` / ``GENIE_OPINFO_UPDATE=1``: rewrite expected_failures.toml from this run.
- ``--opinfo-timeout S`` / ``GENIE_OPINFO_TIMEOUT``: the most one case may take (default 60 s).
- ``--opinfo-report PATH`` / ``GENIE_OPINFO_REPORT``: the JSON report (default build/opinfo/report-MODE.json).
- ``GENIE_OPINFO_SERVER_DEVICES``: the server's ``--devices`` (default ``cpu``; ``cuda:0`` on a GPU host).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import opinfo_expected
import pytest
from opinfo_cases import Case, mode_from_env, select, server_devices
from opinfo_pool import Pool

_SWEEP = pytest.StashKey["Sweep"]()
ROOT = Path(__file__).resolve().parents[3]


class Sweep:
    """The session's cases, pool, expected list and results."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.mode = mode_from_env()
        self.update = bool(_option(config, "update_expected", False)) or os.environ.get("GENIE_OPINFO_UPDATE") == "1"
        self.timeout = float(_option(config, "opinfo_timeout", None) or os.environ.get("GENIE_OPINFO_TIMEOUT") or 60)
        report = _option(config, "opinfo_report", None) or os.environ.get("GENIE_OPINFO_REPORT")
        self.report_path = Path(report) if report else ROOT / "build" / "opinfo" / f"report-{self.mode}.json"
        self.expected = opinfo_expected.load()
        self.results: dict[Case, dict[str, Any]] = {}
        self.pool = Pool()
        self.all_cases = self.pool.list_cases()
        self.cases = select(self.all_cases, self.mode)
        self.started = time.monotonic()


def _option(config: pytest.Config, name: str, default: Any) -> Any:
    try:
        return config.getoption(name)
    except ValueError:  # this conftest was not an initial one: its options are not registered
        return default


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("genie-opinfo", "genie OpInfo sweep (tests/device/opinfo)")
    group.addoption("--update-expected", action="store_true", default=False,
                    help="rewrite tests/device/opinfo/expected_failures.toml from this run's failures")
    group.addoption("--opinfo-timeout", type=float, default=None, help="seconds one OpInfo case may take (60)")
    group.addoption("--opinfo-report", default=None, help="where to write the pass-rate JSON report")


def _sweep(config: pytest.Config) -> Sweep:
    if _SWEEP not in config.stash:
        config.stash[_SWEEP] = Sweep(config)
    return config.stash[_SWEEP]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "opinfo_case" in metafunc.fixturenames:
        cases = _sweep(metafunc.config).cases
        metafunc.parametrize("opinfo_case", cases, ids=[c.test_id for c in cases])


@pytest.fixture(scope="session")
def opinfo_sweep(request: pytest.FixtureRequest) -> Iterator[Sweep]:
    """The session's sweep, its worker connected to a real ``genie serve`` process (stopped at the end)."""
    sweep = _sweep(request.config)
    sweep.pool.connect()
    try:
        yield sweep
    finally:
        sweep.pool.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    sweep = session.config.stash.get(_SWEEP, None)
    if sweep is None:
        return
    sweep.pool.close()  # also when no opinfo test ran (deselected): the listing worker must not outlive us
    if not sweep.results:
        return
    if sweep.update:
        opinfo_expected.save(opinfo_expected.updated(sweep.expected, sweep.results))
    rows = opinfo_expected.pass_rates(sweep.results)
    sweep.report_path.parent.mkdir(parents=True, exist_ok=True)
    sweep.report_path.write_text(json.dumps({
        "mode": sweep.mode,
        "torch": _torch_version(),
        "python": platform.python_version(),
        "server_devices": server_devices(),
        "seconds": round(time.monotonic() - sweep.started, 1),
        "restarts": sweep.pool.restarts,
        "rates": rows,
        "cases": {c.test_id: r for c, r in sorted(sweep.results.items())},
    }, indent=1) + "\n", encoding="utf-8")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    sweep = config.stash.get(_SWEEP, None)
    if sweep is None or not sweep.results:
        return
    for line in opinfo_expected.summary_lines(sweep.mode, opinfo_expected.pass_rates(sweep.results)):
        terminalreporter.write_line(line)
    restarts = sweep.pool.restarts
    terminalreporter.write_line(f"genie opinfo ({sweep.mode}): {len(sweep.results)} cases, worker restarts "
                                f"{restarts['worker']}, server restarts {restarts['server']}; report {sweep.report_path}")
    if sweep.update:
        terminalreporter.write_line(f"genie opinfo: rewrote {opinfo_expected.EXPECTED_PATH}")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
