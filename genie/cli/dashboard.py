"""``genie dashboard``: a live terminal view of a running cluster (see :mod:`genie.dashboard`).

Polls the master every ``--refresh`` seconds and follows its event stream; an
unreachable master is shown ("master unreachable, retrying") until it answers. ``q``
quits with exit code 0, Ctrl-C with 130. Needs rich (``pip install 'genie[dashboard]'``).
"""

from __future__ import annotations

import argparse
from typing import Any

from genie.cli._master import add_master_arguments, master_address
from genie.errors import ConfigError, GenieError


def register(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="live terminal dashboard of a running cluster (q quits)")
    add_master_arguments(p)
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between polls of the master (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0.05 <= args.refresh <= 60:
        raise ConfigError("refresh", args.refresh, "argument --refresh", "seconds from 0.05 to 60")
    host, port = master_address(args)
    try:
        from genie import dashboard
    except ImportError as exc:
        raise GenieError(f"genie dashboard needs rich: pip install 'genie[dashboard]' ({exc})") from None
    return dashboard.run(host, port, refresh=args.refresh, timeout=args.timeout)
