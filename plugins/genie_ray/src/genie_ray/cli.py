"""``genie ray up|down|status`` (and ``python -m genie_ray``, ``genie-ray``).

Exit codes: 0 done, 1 a genie error (printed on one line), 3 ``status`` found no genie
cluster in that Ray namespace.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from genie.config import ClusterConfig
from genie.errors import GenieError

#: ``genie ray status`` when the namespace holds no genie cluster.
NOT_RUNNING = 3


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="the Ray cluster's address, HOST:PORT (default: RAY_ADDRESS, else this machine's cluster)")
    p.add_argument("--name", default="genie", help="the genie cluster's Ray namespace (default genie)")


def register(sub: Any) -> None:
    """Add ``ray`` with its subcommands ``up``, ``down`` and ``status``."""
    parser = sub.add_parser("ray", help="run genie on an existing Ray cluster (up, down, status)")
    actions = parser.add_subparsers(dest="ray_command", metavar="ACTION", required=True)
    start = actions.add_parser("up", help="start the master and one worker per GPU node as Ray actors")
    _common(start)
    start.add_argument("--resource", default="GPU",
                       help="the Ray resource a worker reserves (default GPU; a custom one for nodes without GPUs)")
    start.add_argument("--per-worker", type=float, default=None,
                       help="units of --resource per worker (default: all of a node's, one worker per node)")
    start.add_argument("--devices", default="auto", help="what each worker serves (default auto: its GPUs)")
    start.add_argument("--master-devices", default="cpu", help="what the master itself serves (default cpu)")
    start.add_argument("--port", type=int, default=0, help="the master's control port (default: any free port)")
    start.add_argument("--no-follow", dest="follow", action="store_false",
                       help="do not start workers on Ray nodes that join later")
    start.add_argument("--heartbeat-interval", type=float, default=None)
    start.add_argument("--heartbeat-timeout", type=float, default=None)
    start.add_argument("--insecure", action="store_true", default=None,
                       help="serve non-loopback addresses without a cluster token (see docs/SECURITY.md)")
    start.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every worker (default 180)")
    start.set_defaults(func=run_up)
    stop = actions.add_parser("down", help="stop and remove every genie actor and placement group")
    _common(stop)
    stop.set_defaults(func=run_down)
    show = actions.add_parser("status", help="the master's address and the workers Ray runs (JSON)")
    _common(show)
    show.set_defaults(func=run_status)


def run_up(args: argparse.Namespace) -> int:
    from genie_ray.cluster import up

    # The cluster token comes from this command's GENIE_* environment, like every genie command's.
    config = ClusterConfig.from_sources()
    options: dict[str, Any] = {"heartbeat_interval": args.heartbeat_interval,
                               "heartbeat_timeout": args.heartbeat_timeout, "insecure": args.insecure}
    if config.auth_token:
        options["auth_token"] = config.auth_token
    result = up(args.address, name=args.name, resource=args.resource, per_worker=args.per_worker,
                devices=args.devices, master_devices=args.master_devices, port=args.port, follow=args.follow,
                timeout=args.timeout, **{k: v for k, v in options.items() if v is not None})
    host, port = result["master"]
    print(f"genie ray up: master={host}:{port} workers={len(result['workers'])} name={result['name']}")
    for worker in result["workers"]:
        print(f"  {worker['node_id']} data={worker['host']}:{worker['data_port']} devices={worker['devices']}")
    return 0


def run_down(args: argparse.Namespace) -> int:
    from genie_ray.cluster import down

    removed = down(args.address, name=args.name)
    print(f"genie ray down: removed {removed['actors']} actor(s) and {removed['placement_groups']} "
          f"placement group(s) from namespace {args.name}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from genie_ray.cluster import status

    found = status(args.address, name=args.name)
    if found is None:
        print(f"genie ray status: no genie cluster in Ray namespace {args.name!r}", file=sys.stderr)
        return NOT_RUNNING
    print(json.dumps(found, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m genie_ray ACTION ...``."""
    parser = argparse.ArgumentParser(prog="genie-ray", description="genie on an existing Ray cluster")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(["ray", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except GenieError as exc:
        print(f"genie ray: error: {exc}", file=sys.stderr)
        return 1
