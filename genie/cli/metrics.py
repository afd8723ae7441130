"""``genie metrics``: the master's Prometheus text, fetched from its ``/metrics`` endpoint.

The QUERY reply names the master's metrics port; the endpoint is on the master's
host as given by ``--master``. A master started without ``--metrics-port`` has no
endpoint: exit 1 with how to start one. Exit 2 when the master or the endpoint
cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from typing import Any

from genie.cli._master import Unreachable, add_master_arguments, master_address, operator_command, query
from genie.cluster.overview import mapping
from genie.errors import GenieError


def register(sub: Any) -> None:
    p = sub.add_parser("metrics", help="print the master's Prometheus metrics (text exposition format)")
    add_master_arguments(p)
    p.set_defaults(func=run)


def metrics_url(args: argparse.Namespace, reply: dict[str, Any]) -> str:
    host, port = master_address(args)
    master = mapping(reply.get("master"))
    metrics_port = master.get("metrics_port") or 0
    if not metrics_port:
        raise GenieError(f"the master at {host}:{port} has no metrics endpoint; "
                         "start genie serve with --metrics-port PORT")
    return f"http://{f'[{host}]' if ':' in host else host}:{metrics_port}/metrics"


@operator_command
def run(args: argparse.Namespace) -> int:
    url = metrics_url(args, query(args))
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as answer:  # noqa: S310 - http only, built above
            text = answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise GenieError(f"{url} answered {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise Unreachable(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}") from None
    sys.stdout.write(text)
    return 0
