"""Run a genie GPU server (the master) with its metrics endpoint, and say where to point clients.

Run it::

    .venv/bin/python examples/gpu_server.py                       # 127.0.0.1:5555, metrics on :9400
    GENIE_AUTH_TOKEN=$(openssl rand -hex 32) \
        .venv/bin/python examples/gpu_server.py --host 0.0.0.0 --port 5555 --metrics-port 9400 --devices auto

Serving beyond loopback needs a cluster token (GENIE_AUTH_TOKEN or GENIE_AUTH_TOKEN_FILE,
the same on every node, client and operator command); ``genie serve`` refuses without
one unless ``--insecure`` is given (passed through here).

It starts ``genie serve --port PORT --metrics-port MPORT --devices DEVICES`` as a
child process (exactly what you would type yourself; ``--port 0`` takes any free port),
waits for its ready line, prints how clients, workers and operators reach it, and
leaves the server's log on stderr until Ctrl-C, which stops the server and exits 0.
``--devices auto`` serves every CUDA GPU, or one CPU device on a machine without one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from _nodes import Node  # examples/_nodes.py: the genie command as a child process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=5555, help="control-plane port (default 5555; 0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=9400, help="/metrics, /healthz, /readyz (default 9400)")
    parser.add_argument("--devices", default="auto", help="'auto' (every CUDA GPU, else one CPU device) or 'cpu,cpu'")
    parser.add_argument("--insecure", action="store_true", help="serve a non-loopback --host without a token")
    args = parser.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server = Node("serve", "--host", args.host, "--port", str(args.port), "--metrics-port",
                      str(args.metrics_port), "--devices", args.devices, *(["--insecure"] if args.insecure else []))
    except RuntimeError as exc:  # e.g. a non-loopback --host without a token: the server said why on stderr
        print(f"gpu_server: {exc}", file=sys.stderr)
        return 1
    try:
        reach = "THIS-HOST" if args.host in ("0.0.0.0", "::") else args.host
        port = server.control_port
        token = "GENIE_AUTH_TOKEN=<the token> " if os.environ.get("GENIE_AUTH_TOKEN") or os.environ.get(
            "GENIE_AUTH_TOKEN_FILE") else ""
        print(f"genie server ready: pid {server.pid}, {server.devices} device(s), node {server.node_id}\n"
              f"  clients:   genie.init_sync(master_addr={reach!r}, master_port={port})\n"
              f"             or {token}GENIE_MASTER_ADDR={reach} GENIE_MASTER_PORT={port}\n"
              f"             then torch.randn(4, 4, device='remote_accelerator:0')\n"
              f"  try:       python examples/basic_client.py --master {reach}:{port}\n"
              f"  workers:   genie worker --master {reach}:{port}\n"
              f"  operators: genie status --master {reach}:{port}   (also health, events, dashboard)\n"
              f"  metrics:   http://{reach}:{server.metrics_port}/metrics  (/healthz, /readyz)\n"
              f"Ctrl-C stops the server.", flush=True)
        while not stop.wait(0.5):  # the server's log goes straight to stderr; watch that it lives
            if not server.alive():
                print("the genie server exited", file=sys.stderr)
                return 1
        print("stopping the genie server", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
