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

import deny_list
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
        self.deny = deny_list.load()
        self.results: dict[Case, dict[str, Any]] = {}
        self.pool = Pool()
        self.all_cases = self.pool.list_cases()
        self.cases = select(self.all_cases, self.mode)
        self.started = time.monotonic()


    def judge(self, case: Case) -> None:
        """Run ``case`` and turn its outcome into the test's verdict: a pass; a skip; a failure listed in
        expected_failures.toml (xfail) or not (fail); a listed case that passes (fail: the list is
        stale); every sample refused by deny-list ops (xfail naming them)."""
        result = self.pool.run(case, self.timeout)
        self.results[case] = result
        listed = self.expected.get(case.key)
        status, reason = result["status"], result.get("reason", "")
        if status == "skip":
            pytest.skip(reason)
        if status == "denied":
            pytest.xfail(f"{reason} (tests/device/deny_list.toml: "
                         f"{'; '.join(self.deny.get(op, '?') for op in result.get('denied', []))})")
        if self.update:
            if status == "fail":
                pytest.xfail(f"recorded in the expected list: {reason}")
            return
        if status == "pass" and listed is not None:
            pytest.fail(f"{case.test_id} passes but expected_failures.toml lists it ({listed!r}): the list is "
                        "stale; remove the entry or regenerate the list with --update-expected")
        if status == "fail":
            if listed is not None:
                pytest.xfail(listed)
            pytest.fail(f"{case.test_id} differs from CPU: {reason}\n(a new failure: fix the device, or list it "
                        "in tests/device/opinfo/expected_failures.toml with the reason; a refusal goes in "
                        "tests/device/deny_list.toml with the reason, if the op is refused on purpose)")


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


#: The fixture each gate's cases parametrize (test_gates.py).
GATE_FIXTURES = {"opinfo_case": "opinfo", "module_case": "module", "optim_case": "optim",
                 "random_case": "random", "amp_case": "amp"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, gate in GATE_FIXTURES.items():
        if fixture in metafunc.fixturenames:
            cases = [c for c in _sweep(metafunc.config).cases if c.gate == gate]
            metafunc.parametrize(fixture, cases, ids=[c.test_id for c in cases])


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
        "denied_ops_reached": sorted({op for r in sweep.results.values() for op in r.get("denied", [])}),
        "cases": {c.test_id: r for c, r in sorted(sweep.results.items())},
    }, indent=1) + "\n", encoding="utf-8")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its controller prints the summary (tests/conftest.py)
        workeroutput["genie_summary"] = _summary(sweep)  # tests/conftest.py SUMMARY_KEY


def _summary(sweep: Sweep) -> list[str]:
    lines = list(opinfo_expected.summary_lines(sweep.mode, opinfo_expected.pass_rates(sweep.results)))
    reached = {op for r in sweep.results.values() for op in r.get("denied", [])}
    lines.append(f"genie gates ({sweep.mode}): deny list {len(sweep.deny)} entries, reached: "
                 f"{', '.join(sorted(reached)) or 'none'}")
    if sweep.mode == "full":
        unused = sorted(set(sweep.deny) - reached)
        if unused:
            lines.append(f"genie gates (full): deny-list entries no sample reached (remove them if "
                         f"the op is allowed now): {', '.join(unused)}")
    restarts = sweep.pool.restarts
    lines.append(f"genie opinfo ({sweep.mode}): {len(sweep.results)} cases, worker restarts "
                 f"{restarts['worker']}, server restarts {restarts['server']}; report {sweep.report_path}")
    if sweep.update:
        lines.append(f"genie opinfo: rewrote {opinfo_expected.EXPECTED_PATH}")
    return lines


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    sweep = config.stash.get(_SWEEP, None)
    if sweep is None or not sweep.results:
        return
    for line in _summary(sweep):
        terminalreporter.write_line(line)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
