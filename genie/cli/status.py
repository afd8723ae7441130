"""``genie status``: every node of a running cluster, its devices' figures, health and backend.

Asks the master once (``--master HOST:PORT``, default the configured master) and
prints tables (nodes, devices, sessions per client and device, failing checks), or with ``--json`` one JSON document: ``{"master": {...}, "nodes":
[...]}`` where each node is :meth:`genie.cluster.overview.NodeView.to_dict`.
Exit code 0, or 2 when the master cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from genie.cli._master import add_master_arguments, master_address, operator_command, query
from genie.cluster import overview
from genie.cluster.overview import mapping


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="show every node of a running cluster: devices, health, backend, heartbeats")
    add_master_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def master_summary(args: argparse.Namespace, reply: dict[str, Any]) -> dict[str, Any]:
    host, port = master_address(args)
    master = mapping(reply.get("master"))
    return {"address": f"{host}:{port}", "node_id": master.get("node_id"), "metrics_port": master.get("metrics_port"),
            "heartbeat_interval": master.get("heartbeat_interval"),
            "heartbeat_timeout": master.get("heartbeat_timeout"), "version": reply.get("version")}


@operator_command
def run(args: argparse.Namespace) -> int:
    reply = query(args)
    views = overview.nodes(reply, now=time.time())
    master = master_summary(args, reply)
    if args.json:
        print(json.dumps({"master": master, "nodes": [v.to_dict() for v in views]}, indent=2))
        return 0
    from rich.console import Console

    from genie.cli.tables import devices_table, health_table, nodes_table, sessions_table

    console = Console()
    if not console.is_terminal:  # a file or a pipe: no terminal to fit, keep rows on one line
        console = Console(width=160)
    counts: dict[str, int] = {}
    for v in views:
        counts[v.status] = counts.get(v.status, 0) + 1
    metrics = f", metrics on port {master['metrics_port']}" if master.get("metrics_port") else ""
    console.print(f"master {master['address']} (node {master['node_id']}){metrics}: {len(views)} nodes, "
                  + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), highlight=False)
    console.print(nodes_table(views))
    console.print(devices_table(views))
    console.print(sessions_table(views))
    console.print(health_table(views))
    return 0
