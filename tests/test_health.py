"""The health checker: aggregation, failing/hanging checks, HEALTH_CHANGED events, scheduling."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from genie.cluster.events import EventBus
from genie.cluster.health import HealthChecker, HealthReport
from genie.config import ClusterConfig
from genie.errors import PluginError
from genie.hookspecs import hookimpl
from genie.testing import wait_until_async
from genie.types import EventType, HealthResult, NodeStatus

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def result_of(report: HealthReport, name: str) -> HealthResult:
    """The result of check ``name``, which must have run."""
    result = report.result(name)
    assert result is not None, f"check {name!r} did not run"
    return result


class Fixed:
    """A check returning a settable grade."""

    def __init__(self, name: str, status: NodeStatus = NodeStatus.HEALTHY) -> None:
        self.name = name
        self.status = status
        self.calls = 0

    def check(self) -> HealthResult:
        self.calls += 1
        return HealthResult(self.name, self.status, f"{self.name} is {self.status.value}")


class Raises:
    name = "explodes"

    def check(self) -> HealthResult:
        raise OSError("sensor unplugged")


class Hangs:
    """Blocks until released; the test always releases it so no thread outlives the test."""

    name = "hangs"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0

    def check(self) -> HealthResult:
        self.started += 1
        self.release.wait(10)
        return HealthResult(self.name, NodeStatus.HEALTHY)


@pytest.fixture
def hangs():
    check = Hangs()
    yield check
    check.release.set()


async def test_grade_is_the_worst_result_and_failing_checks_are_named() -> None:
    checker = HealthChecker(node_id="n1", checks=[Fixed("a"), Fixed("b", NodeStatus.DEGRADED),
                                                  Fixed("c", NodeStatus.UNHEALTHY)])
    report = await checker.check_once()
    assert report.status is NodeStatus.UNHEALTHY
    assert report.failing == ("b", "c")
    assert report.to_dict()["failing"] == ["b", "c"]
    assert checker.status is NodeStatus.UNHEALTHY


async def test_no_checks_is_healthy() -> None:
    assert (await HealthChecker(node_id="n1").check_once()).status is NodeStatus.HEALTHY


async def test_raising_check_is_a_failing_result_naming_it() -> None:
    checker = HealthChecker(node_id="n1", checks=[Raises(), Fixed("ok")])
    report = await checker.check_once()
    failed = report.result("explodes")
    assert failed is not None and failed.status is NodeStatus.UNHEALTHY
    assert "'explodes' raised OSError: sensor unplugged" in failed.message
    assert result_of(report, "ok").status is NodeStatus.HEALTHY


async def test_hanging_check_times_out_without_blocking_the_others(hangs: Hangs) -> None:
    fast = Fixed("fast")
    checker = HealthChecker(node_id="n1", checks=[hangs, fast], interval=1.0, timeout=0.5)
    start = time.monotonic()
    report = await checker.check_once()
    assert time.monotonic() - start < 4.0, "the round waited for the hung check's thread"
    assert result_of(report, "hangs").message == "check 'hangs' timed out after 0.5 s"
    assert result_of(report, "fast").status is NodeStatus.HEALTHY
    # the stuck thread is not started a second time
    again = await checker.check_once()
    assert "still running from an earlier round" in result_of(again, "hangs").message
    assert hangs.started == 1 and fast.calls == 2
    hangs.release.set()

    async def hangs_is_healthy_again() -> bool:
        return result_of(await checker.check_once(), "hangs").status is NodeStatus.HEALTHY

    await wait_until_async(hangs_is_healthy_again, 10, what="'hangs' healthy once released")
    assert hangs.started == 2


async def test_check_breaking_its_contract_fails() -> None:
    class Wrong:
        name = "wrong"

        def check(self) -> str:
            return "fine"

    class WrongGrade:
        name = "grade"

        def check(self) -> HealthResult:
            return HealthResult("grade", NodeStatus.CONNECTED)

    report = await HealthChecker(node_id="n1", checks=[Wrong(), WrongGrade()]).check_once()
    assert report.failing == ("wrong", "grade")


async def test_health_changed_is_published_only_when_the_grade_changes(event_recorder) -> None:
    bus = EventBus()
    recorder = event_recorder(bus, types=[EventType.HEALTH_CHANGED])
    disk = Fixed("disk")
    checker = HealthChecker(node_id="n1", bus=bus, checks=[disk, Fixed("memory")])
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        await checker.check_once()  # first grade: None -> healthy
        await checker.check_once()  # unchanged
        disk.status = NodeStatus.CRITICAL
        await checker.check_once()
        await checker.check_once()  # unchanged
        disk.status = NodeStatus.HEALTHY
        await checker.check_once()
        await recorder.wait_for(EventType.HEALTH_CHANGED, count=3)
        bus.close()
    data = [e.data for e in recorder.events]
    assert [(d["previous"], d["status"]) for d in data] == [
        (None, "healthy"), ("healthy", "critical"), ("critical", "healthy")]
    assert data[1]["failing"] == ["disk"] and data[1]["messages"] == {"disk": "disk is critical"}
    assert all(e.source == "n1" for e in recorder.events)


async def test_run_repeats_every_interval_and_includes_hook_checks(genie_pm, register_plugin) -> None:
    from_hook = Fixed("from-hook")

    class Plugin:
        @hookimpl
        def genie_health_checks(self) -> list[object]:
            return [from_hook]

    register_plugin(Plugin())
    # the timeout is generous: on a loaded 2-core machine a check's thread can start 30 ms late, and a round
    # that times it out leaves the next round refusing the check as hung (timeouts have their own tests)
    checker = HealthChecker(genie_pm, node_id="n1", interval=0.03, timeout=5)
    async with anyio.create_task_group() as tg:
        await tg.start(checker.run)
        await wait_until_async(lambda: checker.rounds >= 3 and from_hook.calls >= 3, 20,
                               what="three health rounds that ran the hook's check")
        tg.cancel_scope.cancel()
    names = {c.name for c in checker.checks}
    assert {"from-hook", "memory", "disk"} <= names, "built-in checks come through the hook too"
    assert from_hook.calls >= 3


async def test_checks_added_and_removed_between_rounds() -> None:
    checker = HealthChecker(node_id="n1")
    checker.add_check(Fixed("peers", NodeStatus.DEGRADED))
    assert (await checker.check_once()).status is NodeStatus.DEGRADED
    checker.remove_check("peers")
    assert (await checker.check_once()).results == ()


def test_two_checks_with_one_name_are_an_error_naming_both() -> None:
    checker = HealthChecker(node_id="n1", checks=[Fixed("disk")])

    class OtherDisk(Fixed):
        pass

    with pytest.raises(PluginError, match="two health checks are named 'disk'.*Fixed and .*OtherDisk"):
        checker.add_check(OtherDisk("disk"))
    with pytest.raises(PluginError, match="no check"):
        checker.add_check(object())


def test_from_config_takes_interval_and_timeout() -> None:
    config = ClusterConfig.from_sources({}, health_check_interval=2.0, health_check_timeout=0.5)
    checker = HealthChecker.from_config(config, pm=None, node_id="n1")
    assert (checker.interval, checker.timeout) == (2.0, 0.5)
