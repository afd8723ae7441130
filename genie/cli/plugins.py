"""``genie plugins``: what loaded, versions, hooks, and each transport's probe result (JSON)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import anyio

from genie.plugins import PluginManager
from genie.transport.base import ProbeTarget
from genie.types import ProbeResult


def register(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins and probe their transports (JSON)")
    p.add_argument("--master", default="", help="HOST:PORT to probe against (default: local capabilities only)")
    p.add_argument("--timeout", type=float, default=2.0, help="probe deadline in seconds")
    p.set_defaults(func=run)


async def _probe_all(pm: PluginManager, target: ProbeTarget) -> dict[str, ProbeResult]:
    results: dict[str, ProbeResult] = {}

    async def one(name: str, cls: type) -> None:
        with anyio.move_on_after(target.timeout) as scope:
            results[name] = await cls().probe(target)
        if scope.cancelled_caught:
            results[name] = ProbeResult(name, False, "timeout", f"probe did not answer within {target.timeout:g} s")

    async with anyio.create_task_group() as tg:
        for name, cls in pm.transports().items():
            tg.start_soon(one, name, cls)
    return results


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
    host, _, port = args.master.rpartition(":") if args.master else ("", "", "0")
    target = ProbeTarget(host=host, port=int(port or 0), timeout=args.timeout)
    probes = anyio.run(_probe_all, pm, target)
    print(json.dumps({"plugins": describe(pm, probes)}, indent=2))
    return 0
