"""``genie health``: every serving node's health checks, and an exit code a script can use.

The master holds each node's latest health report (it arrives with the node's
heartbeats), so one QUERY answers for the whole cluster. Exit code 0 only when every
serving node (master and workers; clients are listed but not judged) is connected
and HEALTHY; 1 when any is DEGRADED, UNHEALTHY, CRITICAL, lost, disconnected or has
not reported yet, naming the node and the failing checks; 2 when the master cannot
be reached.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from genie.cli._master import add_master_arguments, operator_command, query
from genie.cli.tables import format_age
from genie.cluster import overview


def register(sub: Any) -> None:
    p = sub.add_parser("health", help="every node's health checks; exit 0 only when all serving nodes are healthy")
    add_master_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--all", action="store_true", help="list every check, not only the failing ones")
    p.set_defaults(func=run)


def text_report(views: list[overview.NodeView], *, show_all: bool) -> list[str]:
    lines = []
    for v in views:
        if not v.serving:
            lines.append(f"{v.node_id} ({v.role}): {v.status}, not judged")
            continue
        grade = (v.health or "no report").upper()
        age = f", reported {format_age(v.health_age)} ago" if v.health_age is not None else ""
        state = v.status if v.status == "connected" else v.status.upper()
        lines.append(f"{v.node_id} ({v.role}): {state}, {grade}{age}")
        if v.status != "connected":
            lines.append(f"  node {v.status}: no heartbeat for {format_age(v.last_heartbeat_age)}"
                         " (the checks below are its last report)")
        for c in v.checks:
            bad = c.get("status") != "healthy"
            if bad or show_all:
                lines.append(f"  {'FAIL' if bad else 'ok  '} {c.get('name')}: {str(c.get('status')).upper()} "
                             f"{c.get('message', '')}".rstrip())
    return lines


@operator_command
def run(args: argparse.Namespace) -> int:
    views = overview.nodes(query(args), now=time.time())
    ok, problems = overview.verdict(views)
    if args.json:
        print(json.dumps({"healthy": ok, "problems": {k: list(v) for k, v in problems.items()},
                          "nodes": [v.to_dict() for v in views]}, indent=2))
    else:
        for line in text_report(views, show_all=args.all):
            print(line)
        if ok:
            print(f"cluster healthy: {sum(v.serving for v in views)} serving nodes connected and HEALTHY")
        else:
            print(f"cluster NOT healthy: {', '.join(problems)}"
                  + "".join(f"\n  {node}: {'; '.join(p[:2])}" for node, p in problems.items()))
    return 0 if ok else 1
