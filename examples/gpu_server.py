"""Run a genie GPU server (the master) with its metrics endpoint, and say where to point clients.

Run it::

    .venv/bin/python examples/gpu_server.py                       # 127.0.0.1:5555, metrics on :9400
    .venv/bin/python examples/gpu_server.py --host 0.0.0.0 --port 5555 --metrics-port 9400 --devices auto

It starts ``genie serve --port PORT --metrics-port MPORT --devices DEVICES`` as a
child process (exactly what you would type yourself), waits for its ready line,
prints how clients, workers and operators reach it, and passes the server's log
through until Ctrl-C, which stops the server and exits 0. ``--devices auto`` serves
every CUDA GPU, or one CPU device on a machine without one.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from genie.cluster.launch import NodeProcess


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=5555, help="control-plane port (default 5555)")
    parser.add_argument("--metrics-port", type=int, default=9400, help="/metrics, /healthz, /readyz (default 9400)")
    parser.add_argument("--devices", default="auto", help="'auto' (every CUDA GPU, else one CPU device) or 'cpu,cpu'")
    args = parser.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = NodeProcess("serve", "--host", args.host, "--port", str(args.port), "--metrics-port",
                         str(args.metrics_port), "--devices", args.devices, ready_timeout=60)
    with server:
        reach = "THIS-HOST" if args.host in ("0.0.0.0", "::") else args.host
        print(f"genie server ready: pid {server.pid}, {server.devices} device(s), node {server.node_id}\n"
              f"  clients:   genie.init_sync(master_addr={reach!r}, master_port={server.control_port})\n"
              f"             or GENIE_MASTER_ADDR={reach} GENIE_MASTER_PORT={server.control_port}\n"
              f"             then torch.randn(4, 4, device='remote_accelerator:0')\n"
              f"  try:       python examples/basic_client.py --master {reach}:{server.control_port}\n"
              f"  workers:   genie worker --master {reach}:{server.control_port}\n"
              f"  operators: genie status --master {reach}:{server.control_port}   (also health, events, dashboard)\n"
              f"  metrics:   http://{reach}:{args.metrics_port}/metrics  (/healthz, /readyz)\n"
              f"Ctrl-C stops the server.", flush=True)
        # pass the server's log through (and keep its pipe from filling up)
        threading.Thread(target=lambda: [sys.stdout.write(line) for line in server.proc.stdout], daemon=True).start()
        while not stop.wait(0.5):
            if server.proc.poll() is not None:
                print(f"genie server exited with code {server.proc.returncode}", file=sys.stderr)
                return 1
        print("stopping the genie server", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
