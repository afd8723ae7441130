"""``python -m genie.server``: a bare data-plane server, without the cluster runtime.

Serves this host's devices to data-plane clients until SIGTERM or SIGINT. When
ready it prints exactly one line to stdout (flushed)::

    genie data plane listening on HOST:PORT devices=N

Options: ``--host`` (default 127.0.0.1), ``--port`` (default 0: any free port),
``--devices`` (``auto``, ``cpu,cpu``, ``cuda:0,cuda:1``), ``--node-id``,
``--backend`` (default tcp), ``--insecure`` (a non-loopback ``--host`` without a
cluster token; refused otherwise), ``--isolation`` (``process`` or ``none``), ``--op-deadline``,
``--cache-bytes``, ``--share-cache`` (the session options ``genie serve`` and ``genie worker`` share:
genie.cli.options), ``--log-level``. What isolation enforces is written to stderr. Limits come from the ``GENIE_*``
environment (``GENIE_MAX_SESSION_BYTES``, ``GENIE_MAX_SESSION_HANDLES``,
``GENIE_MAX_FRAME_BYTES``, ``GENIE_AUTH_TOKEN``, ``GENIE_HANDSHAKE_TIMEOUT``,
``GENIE_MAX_PREAUTH_PER_SOURCE``, ``GENIE_MAX_PREAUTH``, ``GENIE_MAX_SESSIONS``). ``genie serve`` runs the same
server inside the cluster runtime; this entry point is for tests, benchmarks
and embedding experiments.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from genie.cli.options import add_session_options, session_config
from genie.errors import GenieError, PluginError
from genie.plugins import PluginManager
from genie.server.isolation import zygote

log = logging.getLogger("genie.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a bare data-plane server."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    p.add_argument("--backend", default="tcp", help="transport to listen with (default tcp)")
    add_session_options(p)


def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT; prints the ready line once listening."""
    config = session_config(args, data_port=args.port)
    if config.isolation == "process":
        zygote.start()  # importing torch now (this process needs none for CPU devices: genie.server.host)
    from genie.server.host import parse_devices
    from genie.server.node import DataPlaneServer

    devices = parse_devices(config.devices, source=config.sources.get("devices", "argument devices"))
    transports = PluginManager().transports()
    if args.backend not in transports:
        raise PluginError(f"no installed plugin provides transport {args.backend!r}; "
                          f"installed: {', '.join(sorted(transports)) or 'none'}")
    server = DataPlaneServer(transports[args.backend](), args.host, config.data_port, devices, config)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("received signal %d, stopping", signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        sys.stderr.write(server.isolation_summary + "\n")  # stdout carries the ready line only
        sys.stdout.write(f"genie data plane listening on {args.host}:{server.port} devices={len(devices)}\n")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m genie.server``."""
    parser = argparse.ArgumentParser(prog="python -m genie.server", description="Run a bare genie data-plane server.")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return serve(args)
    except GenieError as exc:
        print(f"genie data plane: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
