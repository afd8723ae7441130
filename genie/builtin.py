"""Built-in plugin: the core's own hook implementations (host metrics, the logging event sink).

Built-in behaviour goes through the same hooks as third-party plugins, so a site
can see it in ``genie plugins`` and a test can unregister it.
"""

from __future__ import annotations

import logging
from typing import Any

from genie.hookspecs import EventSink, HealthCheck, hookimpl
from genie.types import ClusterEvent, NodeInfo

event_log = logging.getLogger("genie.events")


class LoggingEventSink:
    """Logs every cluster event to the ``genie.events`` logger."""

    name = "logging"

    def handle(self, event: ClusterEvent) -> None:
        event_log.info("%s from %s %s", event.type.value, event.source, event.data or "")


@hookimpl
def genie_event_sinks() -> list[EventSink]:
    return [LoggingEventSink()]


# -- host metrics and health checks ------------------------------------------------------------
@hookimpl
def genie_node_metrics(node: NodeInfo) -> dict[str, Any]:
    """The host's figures (CPU, load, memory, disk of /, network counters) under ``"host"``."""
    from genie.cluster.host import host_metrics

    return {"host": host_metrics()}


@hookimpl
def genie_health_checks() -> list[HealthCheck]:
    """Host memory pressure and disk space of /."""
    from genie.cluster.checks import DiskSpaceCheck, MemoryPressureCheck

    return [MemoryPressureCheck(), DiskSpaceCheck("/")]
