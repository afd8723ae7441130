"""``genie plugins``: what loaded, versions, hooks, and each transport's probe result (JSON)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from genie.cli.discover import target_from_args
from genie.config import ClusterConfig
from genie.plugins import PluginManager
from genie.transport.discovery import discover_sync
from genie.types import ProbeResult


def register(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins and probe their transports (JSON)")
    p.add_argument("--master", default=None,
                   help="HOST:PORT to probe against (default: GENIE_MASTER_ADDR[:GENIE_MASTER_PORT] when set, "
                        "else local capabilities only)")
    p.add_argument("--timeout", type=float, default=2.0, help="probe deadline in seconds")
    p.set_defaults(func=run)


def describe(pm: PluginManager, probes: dict[str, ProbeResult]) -> list[dict[str, Any]]:
    pm.transports()
    owners = getattr(pm, "transport_owners", {})
    out = []
    for name, record in pm.records.items():
        transports = [t for t, owner in owners.items() if owner == name]
        out.append(
            {
                "name": name,
                "distribution": record.distribution,
                "version": record.version,
                "path": record.path,
                "builtin": record.builtin,
                "hooks": pm.hooks_of(name),
                "transports": {t: probes[t].to_dict() for t in transports if t in probes},
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    pm = PluginManager()
    target = target_from_args(args, ClusterConfig.from_sources())
    probes = dict(discover_sync(pm, target).results)
    print(json.dumps({"plugins": describe(pm, probes)}, indent=2))
    return 0
