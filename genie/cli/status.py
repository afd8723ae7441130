"""``genie status``: every node of a running cluster, its devices' figures, health and backend.

Asks the master once (``--master HOST:PORT``, default the configured master) and
prints tables (nodes, devices, sessions per client and device, failing checks) and where new work
without a device index would be placed (:func:`placement`), or with ``--json`` one JSON document:
``{"master": {...}, "nodes": [...], "placement": {...}}`` where each node is
:meth:`genie.cluster.overview.NodeView.to_dict`.
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


def placement(reply: dict[str, Any]) -> dict[str, Any]:
    """Where new work without an index would go now (docs/placement.md), for a client with no data in
    the cluster and no measured link, with this host's genie_placement_score hook if a plugin has one:
    ``{"device", "index", "score", "policy", "candidates", "excluded"}``, or ``{"error": why}``."""
    from genie.cluster.placement import choose, cluster_candidates
    from genie.errors import DeviceError
    from genie.plugins import get_plugin_manager

    try:
        decision = choose(cluster_candidates(reply), pm=get_plugin_manager())
    except DeviceError as exc:
        return {"error": str(exc)}
    out = decision.event("genie status").data
    out["excluded"] = {f"remote_accelerator:{i}": why for i, why in sorted(decision.excluded.items())}
    return out


@operator_command
def run(args: argparse.Namespace) -> int:
    reply = query(args)
    views = overview.nodes(reply, now=time.time())
    master = master_summary(args, reply)
    placed = placement(reply)
    if args.json:
        print(json.dumps({"master": master, "nodes": [v.to_dict() for v in views], "placement": placed},
                         indent=2))
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
    if "error" in placed:
        console.print(f"placement: {placed['error']}", highlight=False)
    else:
        runners = ", ".join(f"{c['index']}: {c['score']:g}" for c in placed["candidates"][1:])
        console.print(f"placement: new work without an index goes to {placed['device']} (score {placed['score']:g}, "
                      f"{placed['policy']} policy{'; then ' + runners if runners else ''}; "
                      f"{len(placed['excluded'])} excluded)", highlight=False)
    return 0
