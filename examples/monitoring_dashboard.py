"""A local cluster (a master and one worker) and the live dashboard watching it.

Run it in a terminal::

    .venv/bin/python examples/monitoring_dashboard.py
    .venv/bin/python examples/monitoring_dashboard.py --workers 2 --refresh 0.5

It starts ``genie serve`` (with a metrics port) and ``genie worker`` as child
processes with short heartbeat and poll intervals, then opens the dashboard on them
(``genie dashboard --master 127.0.0.1:PORT`` would show the same). Try killing the
worker from another terminal (the pid is printed): within about a second it shows
as LOST. ``q`` quits; the children are stopped on every way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import socket
import sys

from genie.cli import dashboard
from genie.cluster.launch import NodeProcess

FAST = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "2", "--gpu-poll-interval", "0.5",
        "--health-check-interval", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="worker processes to start (default 1)")
    parser.add_argument("--refresh", type=float, default=1.0, help="dashboard refresh in seconds (default 1)")
    parser.add_argument("--devices", default="cpu", help="devices of each node (default 'cpu'; 'auto' for GPUs)")
    args = parser.parse_args(argv)

    port, metrics_port = free_port(), free_port()
    children: list[NodeProcess] = []
    try:
        children.append(NodeProcess("serve", "--port", str(port), "--metrics-port", str(metrics_port), "--devices",
                                    args.devices, "--node-id", "master", *FAST).start())
        for i in range(args.workers):
            children.append(NodeProcess("worker", "--master", f"127.0.0.1:{port}", "--devices", args.devices,
                                        "--node-id", f"worker-{i + 1}", *FAST).start())
        for child in children:
            print(f"started {child.node_id} (pid {child.pid})")
        print(f"master 127.0.0.1:{port}, metrics http://127.0.0.1:{metrics_port}/metrics; opening the dashboard")
        return dashboard.run("127.0.0.1", port, refresh=args.refresh)
    except KeyboardInterrupt:
        return 130
    finally:
        for child in children:
            child.stop()
        print(f"stopped {len(children)} genie process(es)")


if __name__ == "__main__":
    sys.exit(main())
