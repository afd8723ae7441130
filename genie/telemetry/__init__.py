"""Telemetry: genie's OpenTelemetry meters, their exporters, and a node's HTTP endpoint.

- :mod:`genie.telemetry.meters`: :class:`Telemetry`, the instruments (OpenTelemetry names).
- :mod:`genie.telemetry.exporters`: Prometheus (a private ``prometheus_client`` registry) and
  OTLP (when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set).
- :mod:`genie.telemetry.endpoint`: :class:`MetricsServer`, ``/metrics``, ``/healthz``, ``/readyz``.

Wiring (the cluster runtime does this for every master and worker)::

    telemetry = Telemetry(node_id=node.node_id)
    telemetry.watch_node(monitor=monitor, server=dataplane_server.metrics)
    telemetry.watch_membership(membership)            # the master only
    telemetry.follow_health(bus)
    server = MetricsServer(telemetry, port=9100, ready=lambda: runtime.ready)
    async with anyio.create_task_group() as tg:
        await tg.start(server.run)                    # or server.start() / server.stop()
"""

from genie.telemetry.endpoint import MetricsServer
from genie.telemetry.exporters import PROMETHEUS_CONTENT_TYPE, PrometheusExport, otlp_configured, otlp_reader
from genie.telemetry.meters import HEALTH_VALUES, LatencyCollector, Telemetry

__all__ = ["HEALTH_VALUES", "PROMETHEUS_CONTENT_TYPE", "LatencyCollector", "MetricsServer", "PrometheusExport",
           "Telemetry", "otlp_configured", "otlp_reader"]
