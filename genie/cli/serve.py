"""``genie serve``: run this host's data-plane server until SIGTERM or SIGINT.

When the server is ready it prints exactly one line to stdout::

    genie data plane listening on HOST:PORT devices=N

so scripts and tests can read the port it picked.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from genie.config import ClusterConfig
from genie.errors import PluginError
from genie.plugins import PluginManager
from genie.server import DataPlaneServer, parse_devices

log = logging.getLogger("genie.cli.serve")


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve this host's devices on the data plane")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    p.add_argument("--devices", default=None, help="'auto' (every GPU, else one CPU), or a list like 'cpu,cpu'")
    p.add_argument("--node-id", default=None, help="this node's id (default: host name and process id)")
    p.add_argument("--backend", default="tcp", help="transport to listen with (default tcp)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = ClusterConfig.from_sources(devices=args.devices, node_id=args.node_id, data_port=args.port)
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
        sys.stdout.write(f"genie data plane listening on {args.host}:{server.port} devices={len(devices)}\n")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0
