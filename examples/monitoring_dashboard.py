"""A local cluster (a master and one worker) and the live dashboard watching it.

Run it in a terminal::

    .venv/bin/python examples/monitoring_dashboard.py
    .venv/bin/python examples/monitoring_dashboard.py --workers 2 --refresh 0.5

It starts ``genie serve --port 0`` (any free port) and ``genie worker`` as child
processes with short heartbeat and poll intervals, then opens the dashboard on them
(``genie dashboard --master 127.0.0.1:PORT`` would show the same). Try killing the
worker from another terminal (the pid is printed): within about a second it shows
as LOST. ``q`` quits; the children are stopped on every way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from _nodes import Node  # examples/_nodes.py: the genie command as a child process

from genie.cli import dashboard

FAST = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "2", "--gpu-poll-interval", "0.5",
        "--health-check-interval", "2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1, help="worker processes to start (default 1)")
    parser.add_argument("--refresh", type=float, default=1.0, help="dashboard refresh in seconds (default 1)")
    parser.add_argument("--devices", default="cpu", help="devices of each node (default 'cpu'; 'auto' for GPUs)")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve the master's /metrics here (default: off)")
    args = parser.parse_args(argv)

    children: list[Node] = []
    try:
        # --port 0: any free port (the ready line says which); the logs would garble the dashboard
        master = Node("serve", "--port", "0", "--metrics-port", str(args.metrics_port), "--devices", args.devices,
                      "--node-id", "master", *FAST, stderr=subprocess.DEVNULL)
        children.append(master)
        port = master.control_port
        for i in range(args.workers):
            children.append(Node("worker", "--master", f"127.0.0.1:{port}", "--devices", args.devices,
                                 "--node-id", f"worker-{i + 1}", *FAST, stderr=subprocess.DEVNULL))
        for child in children:
            print(f"started {child.node_id} (pid {child.pid})")
        metrics = f", metrics http://127.0.0.1:{master.metrics_port}/metrics" if master.metrics_port else ""
        print(f"master 127.0.0.1:{port}{metrics}; opening the dashboard")
        return dashboard.run("127.0.0.1", port, refresh=args.refresh)
    except KeyboardInterrupt:
        return 130
    finally:
        for child in children:
            child.stop()
        print(f"stopped {len(children)} genie process(es)")


if __name__ == "__main__":
    sys.exit(main())
