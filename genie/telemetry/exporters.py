"""Where genie's meters go: Prometheus text on a private registry, and OTLP when configured.

- :class:`PrometheusExport`: OpenTelemetry's ``PrometheusMetricReader`` registered in a
  ``prometheus_client.CollectorRegistry`` of genie's own (never the global ``REGISTRY``,
  so an application's own Prometheus metrics are left alone); :meth:`PrometheusExport.text`
  is the exposition ``/metrics`` serves, written by ``prometheus_client``.
- :func:`otlp_reader`: a ``PeriodicExportingMetricReader`` over the OTLP/HTTP exporter when
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``) is set, as
  OpenTelemetry users expect; the exporter reads the rest of the standard ``OTEL_*``
  variables (headers, timeout, ``OTEL_METRIC_EXPORT_INTERVAL``) itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

log = logging.getLogger("genie.telemetry")

#: The content type of :meth:`PrometheusExport.text` (the classic text format every Prometheus reads).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Variables that switch the OTLP exporter on.
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


class PrometheusExport:
    """A private Prometheus registry fed by an OpenTelemetry reader (plus any extra collectors)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        # Scope labels (otel_scope_name=...) on every series add nothing here: genie has one meter.
        self.reader = PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)

    def add(self, collector: Collector) -> None:
        """Expose a ``prometheus_client`` collector beside the meters (e.g. the op latency histogram)."""
        self.registry.register(collector)

    def text(self) -> bytes:
        """The exposition of every family, in Prometheus text format 0.0.4."""
        return generate_latest(self.registry)


def otlp_configured(environ: Mapping[str, str] | None = None) -> bool:
    """True when an OTLP endpoint is set in the environment."""
    env = os.environ if environ is None else environ
    return any(env.get(name, "").strip() for name in OTLP_ENDPOINT_VARIABLES)


def otlp_reader(environ: Mapping[str, str] | None = None) -> MetricReader | None:
    """A periodic OTLP/HTTP reader when :func:`otlp_configured`, else None."""
    if not otlp_configured(environ):
        return None
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    env = os.environ if environ is None else environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip()
    if not endpoint:  # the generic endpoint is a base URL: the signal's path goes after it (OTLP spec)
        endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip().rstrip("/") + "/v1/metrics"
    log.info("exporting metrics over OTLP/HTTP to %s", endpoint)
    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint))
