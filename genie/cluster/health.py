"""The health checker: runs every health check on a schedule and grades the node.

Checks come from the ``genie_health_checks`` hook (collected once, when the checker
starts) and from :meth:`HealthChecker.add_check` (the runtime's peer-connectivity
check). Every ``health_check_interval`` each check runs in its own worker thread
within ``health_check_timeout``; the node's grade is the worst of the results
(:func:`genie.types.worst_health`), and a change of grade is published as a
HEALTH_CHANGED event::

    checker = HealthChecker.from_config(config, pm=pm, node_id=node.node_id, bus=bus)
    checker.add_check(PeerConnectivityCheck(peers))
    async with anyio.create_task_group() as tg:
        await tg.start(checker.run)      # first round starts at once; cancel tg to stop
        ...
        checker.status                   # NodeStatus, or None before the first round

A check that raises, returns something other than a HealthResult, or overruns its
timeout is itself a failing result naming the check; it never delays the others.
A check whose thread is still stuck from an earlier round is not started again
(that would leak a thread a round): it is reported failing until its thread ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from genie.errors import ConfigError, PluginError
from genie.types import ClusterEvent, EventType, HealthResult, NodeStatus, worst_health

if TYPE_CHECKING:
    from genie.cluster.events import EventBus
    from genie.config import ClusterConfig
    from genie.plugins import PluginManager

log = logging.getLogger("genie.cluster.health")


@attrs.frozen
class HealthReport:
    """One round of checks: every result and the node's grade (the worst of them)."""

    node_id: str
    status: NodeStatus
    results: tuple[HealthResult, ...]
    timestamp: float = attrs.field(factory=time.time)

    @property
    def failing(self) -> tuple[str, ...]:
        """Names of the checks that were not HEALTHY, in check order."""
        return tuple(r.name for r in self.results if r.status is not NodeStatus.HEALTHY)

    def result(self, name: str) -> HealthResult | None:
        """The result of the check called ``name``, if it ran."""
        return next((r for r in self.results if r.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a heartbeat or ``genie status``."""
        return {
            "node_id": self.node_id,
            "status": self.status.value,
            "failing": list(self.failing),
            "results": [r.to_dict() for r in self.results],
            "timestamp": self.timestamp,
        }


def check_name(check: Any) -> str:
    """A check's declared ``name`` (or its class name when it declares none)."""
    name = getattr(check, "name", None)
    return name if isinstance(name, str) and name else type(check).__name__


class HealthChecker:
    """Runs health checks every ``interval`` seconds, each within ``timeout``, and grades the node.

    :param pm: plugin manager whose ``genie_health_checks`` hook supplies checks
        (None: only the ``checks`` given here and added later).
    :param node_id: the node being checked (the source of HEALTH_CHANGED events).
    :param bus: where HEALTH_CHANGED goes (None: nowhere).
    :param checks: checks to run besides the hook's.
    :param failure_status: the grade of a check that raised, hung or broke its contract.
    """

    def __init__(
        self,
        pm: PluginManager | None = None,
        *,
        node_id: str,
        bus: EventBus | None = None,
        checks: Iterable[Any] = (),
        interval: float = 30.0,
        timeout: float = 5.0,
        failure_status: NodeStatus = NodeStatus.UNHEALTHY,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ConfigError("health_check_interval/timeout", (interval, timeout), "argument",
                              "positive numbers of seconds")
        self.pm = pm
        self.node_id = node_id
        self.bus = bus
        self.interval = interval
        self.timeout = timeout
        self.failure_status = failure_status
        self._lock = threading.Lock()
        self._checks: dict[str, Any] = {}
        self._hook_loaded = False
        self._busy: dict[str, float] = {}  # check name -> monotonic start of a thread still running
        self.last_report: HealthReport | None = None
        self.rounds = 0
        for check in checks:
            self.add_check(check)

    @classmethod
    def from_config(
        cls, config: ClusterConfig, *, pm: PluginManager | None, node_id: str, bus: EventBus | None = None,
        **kwargs: Any,
    ) -> HealthChecker:
        """A checker with ``health_check_interval`` and ``health_check_timeout`` from ``config``."""
        return cls(pm, node_id=node_id, bus=bus, interval=config.health_check_interval,
                   timeout=config.health_check_timeout, **kwargs)

    # -- the checks -------------------------------------------------------------------------
    def add_check(self, check: Any) -> None:
        """Run ``check`` from the next round on (any thread); two checks with one name are a PluginError."""
        if not callable(getattr(check, "check", None)):
            raise PluginError(f"health check {check!r} has no check() method")
        name = check_name(check)
        with self._lock:
            if name in self._checks and self._checks[name] is not check:
                raise PluginError(
                    f"two health checks are named {name!r}: {type(self._checks[name]).__qualname__} and "
                    f"{type(check).__qualname__}; rename one, or uninstall the plugin that adds it"
                )
            self._checks[name] = check

    def remove_check(self, name: str) -> None:
        """Stop running the check called ``name`` (no error if there is none)."""
        with self._lock:
            self._checks.pop(name, None)

    @property
    def checks(self) -> list[Any]:
        """The checks of the next round (the hook's are included once the checker has started)."""
        with self._lock:
            return list(self._checks.values())

    def _load_hook_checks(self) -> None:
        if self._hook_loaded:
            return
        self._hook_loaded = True
        if self.pm is not None:
            for check in self.pm.health_checks():
                self.add_check(check)

    @property
    def status(self) -> NodeStatus | None:
        """The node's grade after the latest round, or None before the first."""
        return self.last_report.status if self.last_report is not None else None

    # -- running ----------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run a round now and then every ``interval`` until cancelled.

        Reports started once the hook's checks are collected (a PluginError about
        them surfaces from ``task_group.start``), before the first round.
        """
        self._load_hook_checks()
        task_status.started()
        next_at = anyio.current_time()
        while True:
            await self.check_once()
            next_at += self.interval
            now = anyio.current_time()
            if next_at < now:
                next_at = now + self.interval
            await anyio.sleep_until(next_at)

    async def check_once(self) -> HealthReport:
        """Run every check concurrently, grade the node, publish HEALTH_CHANGED if the grade changed."""
        self._load_hook_checks()
        checks = self.checks
        results: list[HealthResult | None] = [None] * len(checks)

        async def one(i: int, check: Any) -> None:
            results[i] = await self._run_check(check)

        async with anyio.create_task_group() as tg:
            for i, check in enumerate(checks):
                tg.start_soon(one, i, check)
        final = tuple(r for r in results if r is not None)
        report = HealthReport(self.node_id, worst_health([r.status for r in final]), final)
        previous, self.last_report = self.last_report, report
        self.rounds += 1
        if previous is None or previous.status is not report.status:
            self._announce(previous, report)
        return report

    def _announce(self, previous: HealthReport | None, report: HealthReport) -> None:
        before = previous.status.value if previous is not None else None
        failing = {r.name: r.message for r in report.results if r.status is not NodeStatus.HEALTHY}
        level = logging.INFO if report.status is NodeStatus.HEALTHY else logging.WARNING
        log.log(level, "node %s health %s -> %s%s", self.node_id, before, report.status.value,
                "".join(f"; {name}: {msg}" for name, msg in failing.items()))
        if self.bus is not None:
            self.bus.publish(ClusterEvent(EventType.HEALTH_CHANGED, self.node_id, {
                "status": report.status.value,
                "previous": before,
                "failing": list(report.failing),
                "messages": failing,
            }))

    async def _run_check(self, check: Any) -> HealthResult:
        name = check_name(check)
        with self._lock:
            started = self._busy.get(name)
            if started is None:
                self._busy[name] = time.monotonic()
        if started is not None:
            return HealthResult(name, self.failure_status,
                                f"check {name!r} is still running from an earlier round "
                                f"({time.monotonic() - started:.1f} s); it hangs", {"error": "hung"})

        def call() -> Any:
            try:
                return check.check()
            finally:
                with self._lock:
                    self._busy.pop(name, None)

        try:
            with anyio.move_on_after(self.timeout) as scope:
                result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as exc:
            log.warning("health check %r raised %s: %s", name, type(exc).__name__, exc, exc_info=exc)
            return HealthResult(name, self.failure_status, f"check {name!r} raised {type(exc).__name__}: {exc}",
                                {"error": type(exc).__name__})
        if scope.cancelled_caught:
            log.warning("health check %r did not finish within %g s", name, self.timeout)
            return HealthResult(name, self.failure_status, f"check {name!r} timed out after {self.timeout:g} s",
                                {"error": "timeout"})
        if not isinstance(result, HealthResult) or not result.status.is_health:
            return HealthResult(name, self.failure_status,
                                f"check {name!r} returned {result!r}, not a HealthResult with a health grade",
                                {"error": "contract"})
        return result if result.name == name else attrs.evolve(result, name=name)
