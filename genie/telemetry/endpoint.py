"""The HTTP endpoint of a node: ``/metrics`` (Prometheus text), ``/healthz`` and ``/readyz``.

A small ``ThreadingHTTPServer`` in a daemon thread; ``/metrics`` is written by
:class:`genie.telemetry.exporters.PrometheusExport` (``prometheus_client``) at each scrape.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from genie.errors import ConfigError
from genie.telemetry.exporters import PROMETHEUS_CONTENT_TYPE

if TYPE_CHECKING:
    from genie.telemetry.meters import Telemetry

log = logging.getLogger("genie.telemetry")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        if path == "/metrics":
            try:
                data, status = owner.telemetry.prometheus_bytes(), 200
            except Exception as exc:
                log.exception("collecting metrics failed")
                data, status = f"collecting metrics failed: {type(exc).__name__}\n".encode(), 500
            self._reply(status, data, PROMETHEUS_CONTENT_TYPE)
        elif path == "/healthz":
            self._reply(200, "ok\n")
        elif path == "/readyz":
            ready, why = owner.readiness()
            self._reply(200 if ready else 503, "ready\n" if ready else f"not ready: {why}\n")
        else:
            self._reply(404, "not found: try /metrics, /healthz or /readyz\n")

    def _reply(self, status: int, body: str | bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: MetricsServer


class MetricsServer:
    """A small HTTP server in a thread: ``/metrics`` (Prometheus text), ``/healthz``, ``/readyz``.

    ``/healthz`` answers 200 while the process serves at all; ``/readyz`` answers 200
    when ``ready()`` returns true and 503 otherwise (or when it raises).

    :param telemetry: whose instruments ``/metrics`` shows.
    :param host: address to listen on (default loopback only).
    :param port: TCP port; 0 picks a free one (read :attr:`port` after :meth:`start`).
    :param ready: readiness callback, called per ``/readyz`` request from the server thread.
    """

    def __init__(
        self, telemetry: Telemetry, *, host: str = "127.0.0.1", port: int = 0,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError("metrics_port", port, "argument port", "0 (any free port) or a port up to 65535")
        self.telemetry = telemetry
        self.host = host
        self.requested_port = port
        self.ready = ready
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on (the requested one until started)."""
        return self._server.server_address[1] if self._server is not None else self.requested_port

    @property
    def url(self) -> str:
        """``http://host:port``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def readiness(self) -> tuple[bool, str]:
        """What ``/readyz`` answers: (ready, why not)."""
        if self.ready is None:
            return True, ""
        try:
            return (True, "") if self.ready() else (False, "the readiness check says no")
        except Exception as exc:
            log.warning("readiness callback failed: %s", exc)
            return False, f"readiness check failed: {type(exc).__name__}: {exc}"

    def start(self) -> MetricsServer:
        """Bind and serve in a daemon thread; a port in use is a ConfigError."""
        if self._server is not None:
            return self
        try:
            server = _Server((self.host, self.requested_port), _Handler)
        except OSError as exc:
            raise ConfigError("metrics_port", self.requested_port, "argument port",
                              f"a free port on {self.host}, or 0 for any ({exc.strerror or exc})") from exc
        server.owner = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"genie-metrics-{self.port}", daemon=True)
        self._thread.start()
        log.info("metrics endpoint at %s/metrics", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent; waits for the thread)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        # serve_forever() notices a shutdown request only when its select() wakes: poke it
        # with connections rather than wait out its poll interval.
        stopper = threading.Thread(target=server.shutdown, name="genie-metrics-stop", daemon=True)
        stopper.start()
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        port = server.server_address[1]
        while stopper.is_alive():
            try:
                socket.create_connection((host, port), timeout=0.1).close()
            except OSError:
                pass
            stopper.join(0.02)
        server.server_close()
        if thread is not None:
            thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled: ``await task_group.start(server.run)``; stops the thread on the way out."""
        self.start()
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
