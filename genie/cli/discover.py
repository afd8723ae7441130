"""``genie discover``: every backend, available or not, why, its rank, its figures, and the choice.

Like ``ucx_info -d``: one row per installed transport. Figures are marked
*measured* (found by the probe here, such as TCP's round trip to ``--master``) or
*declared* (the plugin's stated typical value). Without ``--master`` only local
capabilities are shown.

With ``--master``, every backend available here that the master's node serves is then
**measured** through a real session to that node's data port for the backend (ECHO frames,
:mod:`genie.cluster.linkfigures`; bounded by ``--timeout`` per backend, cached per host pair
for ``GENIE_FIGURES_TTL`` seconds, ``--refresh`` measures again), and the choice is ranked by
those figures, among the backends that node serves (the best both ends support). ``--no-measure``
keeps the probes' figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

import attrs

from genie.config import ClusterConfig, env_name
from genie.errors import BackendUnavailableError
from genie.plugins import PluginManager
from genie.security import ClientSecurity
from genie.transport.base import ProbeTarget
from genie.transport.cache import result_from_dict
from genie.transport.discovery import Discovery, discover_sync
from genie.transport.selection import consider, effective_priority, select
from genie.types import ProbeResult

log = logging.getLogger("genie.cli")


def register(sub: Any) -> None:
    p = sub.add_parser("discover", help="probe every network backend and show which one genie would choose")
    p.add_argument("--master", default=None,
                   help="HOST:PORT to probe against (default: GENIE_MASTER_ADDR[:GENIE_MASTER_PORT] when set, "
                        "else local capabilities only)")
    p.add_argument("--backend", default=None, help="a backend option to apply (default: GENIE_BACKEND or auto)")
    p.add_argument("--timeout", type=float, default=None, help="probe deadline in seconds (default: probe_timeout)")
    p.add_argument("--refresh", action="store_true", help="ignore the host-capability cache (and refill it)")
    p.add_argument("--no-measure", action="store_true",
                   help="with --master: do not measure each backend through a session to the master's node")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def parse_master(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) to a pair; an empty text is ``("", 0)``."""
    if not text:
        return "", 0
    from genie.cli._master import parse_master as parse

    return parse(text)


def target_from_args(args: argparse.Namespace, config: ClusterConfig) -> ProbeTarget:
    """The probe target of ``--master`` and ``--timeout`` (or the config's probe_timeout).

    Without ``--master``, the master of ``GENIE_MASTER_ADDR`` (and ``GENIE_MASTER_PORT``) when
    that is set; else no master (local capabilities only).
    """
    if args.master is not None:
        host, port = parse_master(args.master)
    elif env_name("master_addr") in os.environ:
        host, port = config.master_addr, config.master_port
    else:
        host, port = "", 0
    return ProbeTarget(host=host, port=port, timeout=args.timeout or config.probe_timeout)


def figure_text(result: ProbeResult) -> str:
    """``name=value unit (measured|declared)`` for each figure, comma-separated."""
    parts = []
    for key, fig in result.figures.items():
        if fig.unit == "bool":
            value = "yes" if fig.value else "no"
        else:
            value = f"{fig.value:g} {fig.unit}"
        parts.append(f"{key}={value} ({'measured' if fig.measured else 'declared'})")
    return ", ".join(parts) or "-"


def report(pm: PluginManager, config: ClusterConfig, found: Discovery,
           node: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of ``genie discover --json``; with ``node`` (the master's node), chosen among what it serves."""
    error = ""
    offered = list(node.get("backends") or []) if node else None
    peer = f"node {node.get('node_id')}" if node else "the peer"
    candidates, rejected = consider(found.results, pm=pm, config=config, peer_backends=offered, peer=peer)
    try:
        select(found.results, pm=pm, config=config, peer_backends=offered, peer=peer)
    except BackendUnavailableError as exc:
        error = str(exc)
    names = [c.name for c in candidates]
    rows = []
    for name, result in found.results.items():
        priority, overridden = effective_priority(result, pm=pm, config=config)
        row = result.to_dict()
        row.update({
            "priority": priority,
            "default_priority": result.priority,
            "priority_overridden": overridden,
            "cached": name in found.cached,
            "candidate_rank": names.index(name) + 1 if name in names else None,
            "not_candidate_because": rejected.get(name),
        })
        rows.append(row)
    return {
        "backend_option": config.backend.text,
        "target": found.to_dict()["target"],
        "node": {"node_id": node.get("node_id"), "backends": list(node.get("backends") or [])} if node else None,
        "elapsed_ms": round(found.elapsed * 1000, 1),
        "backends": rows,
        "selected": names[0] if names else None,
        "candidates": names,
        "error": error or None,
    }


def table(doc: dict[str, Any]) -> str:
    """The human table of a :func:`report` document: one row per backend, then each one's reason in full."""
    head = ("", "BACKEND", "AVAILABLE", "PRIORITY", "REASON", "FIGURES")
    rows = [head]
    notes = []
    for row in doc["backends"]:
        chosen = "*" if row["name"] == doc["selected"] else ""
        prio = str(row["priority"]) + (f" (hook; default {row['default_priority']})" if row["priority_overridden"] else "")
        code = row["reason_code"]
        if row["available"] and row["not_candidate_because"]:
            code += " (not selectable)"
        avail = "yes" if row["available"] else "no"
        rows.append((chosen, row["name"], avail, prio, code, _figures_of(row)))
        note = row["reason"] or "-"
        if row["available"] and row["not_candidate_because"]:
            note += f"; not a candidate: {row['not_candidate_because']}"
        if row["cached"]:
            note += " [from the host-capability cache]"
        if row["details"].get("measured_on"):
            note += f"; figures measured through {row['details']['measured_on']}"
            if row["details"].get("figures_cached"):
                note += " [from the figures cache]"
        elif row["details"].get("measure_failed"):
            note += f"; not measured: {row['details']['measure_failed']}"
        notes.append(f"  {row['name']}: {note}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    lines += ["", "reasons:", *notes, ""]
    target = doc["target"]
    where = f"{target['host']}:{target['port']}" if target["host"] else "no master (local capabilities only)"
    lines.append(f"probed against {where} in {doc['elapsed_ms']:g} ms (deadline {target['timeout']:g} s)")
    if doc.get("node"):
        lines.append(f"node {doc['node']['node_id']} serves: {', '.join(doc['node']['backends'])} "
                     "(the choice is among those)")
    if doc["selected"]:
        lines.append(f"backend option {doc['backend_option']!r}: would choose {doc['selected']} "
                     f"(then fall back in order: {', '.join(doc['candidates'][1:]) or 'none'})")
    else:
        lines.append(f"backend option {doc['backend_option']!r}: no backend can be chosen")
        lines.append(f"error: {doc['error']}")
    return "\n".join(lines)


def _figures_of(row: dict[str, Any]) -> str:
    return figure_text(result_from_dict(row))


def measured_on_master(pm: PluginManager, config: ClusterConfig, found: Discovery, *,
                       refresh: bool = False) -> tuple[Discovery, dict[str, Any] | None]:
    """``found`` with figures measured through sessions to the master's node, and that node (None: as is).

    The master's own node (role ``server``) is preferred, else the first connected node with devices;
    a master that cannot be asked leaves the probes' figures and logs why.
    """
    from genie.cluster.linkfigures import measure_node
    from genie.cluster.query import query_master_sync
    from genie.errors import GenieError

    target = found.target
    config = attrs.evolve(config, master_addr=target.host, master_port=target.port)
    try:
        view = query_master_sync(target.host, target.port, timeout=max(1.0, target.timeout), config=config)
    except GenieError as exc:
        log.warning("figures stay as probed: %s", exc)
        return found, None
    serving = [n for n in view.get("nodes", []) if n.get("status") == "connected" and n.get("backends")]
    serving.sort(key=lambda n: n.get("role") != "server")
    if not serving:
        log.warning("figures stay as probed: no node of the master at %s:%d serves a data plane",
                    target.host, target.port)
        return found, None
    security = ClientSecurity.from_config(config)
    results = measure_node(pm, config, security, serving[0], found.results, client_id="genie-discover",
                           budget=target.timeout, refresh=refresh)
    return attrs.evolve(found, results=results), serving[0]


def run(args: argparse.Namespace) -> int:
    config = ClusterConfig.from_sources(backend=args.backend)
    pm = PluginManager()
    target = target_from_args(args, config)
    found = discover_sync(pm, target, refresh=args.refresh)
    node = None
    if target.host and not args.no_measure:
        found, node = measured_on_master(pm, config, found, refresh=args.refresh)
    doc = report(pm, config, found, node)
    print(json.dumps(doc, indent=2) if args.json else table(doc))
    return 0 if doc["selected"] else 1
