"""What the operator commands share: ``--master``, one QUERY, and exit code 2 for an unreachable master.

Exit codes of ``genie status``, ``health``, ``metrics``, ``events`` and ``dashboard``:
0 success, 1 a finding (``genie health``: some serving node is not connected and
HEALTHY) or another genie error, 2 the master (or its metrics endpoint) cannot be
reached, 130 interrupted with Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

from genie.errors import ConfigError, TransportError

#: Exit code when the master cannot be reached.
UNREACHABLE = 2


def add_master_arguments(p: argparse.ArgumentParser) -> None:
    """``--master HOST:PORT`` and ``--timeout``."""
    p.add_argument("--master", default=None,
                   help="HOST:PORT of the master's control plane, or an address a plugin resolves such as "
                        "ray://RAY_ADDRESS (default: GENIE_MASTER_ADDR:GENIE_MASTER_PORT, else 127.0.0.1:5555)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the master (default 5)")


def parse_master(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) as a pair; ConfigError naming ``--master`` otherwise."""
    host, sep, port = text.rpartition(":")
    if sep and host and port == "0":
        raise ConfigError("master_port", text, "argument --master",
                          "1..65535; port 0 (any free port) is for `genie serve` only: a worker needs the port "
                          "the master reported in its ready line, and so does every tool")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError("master", text, "argument --master", "HOST:PORT, e.g. 10.0.0.1:5555")
    return host.strip("[]"), int(port)


def master_address(args: argparse.Namespace) -> tuple[str, int]:
    """``--master`` as (host, port), or the configured master (arguments, then GENIE_* environment)."""
    if args.master and "://" not in args.master:
        return parse_master(args.master)
    from genie.config import ClusterConfig
    from genie.plugins import get_plugin_manager

    # ``ray://...`` and other scheme addresses name a master a plugin finds (genie_resolve_master).
    config = ClusterConfig.from_sources(master_addr=args.master).resolve_master(get_plugin_manager())
    return config.master_addr, config.master_port


class Unreachable(Exception):
    """The master (or an endpoint of it) did not answer; the message says which and why."""


def query(args: argparse.Namespace) -> dict[str, Any]:
    """The master's QUERY reply, or :class:`Unreachable`."""
    from genie.cluster.query import query_master_sync

    host, port = master_address(args)
    try:
        return query_master_sync(host, port, timeout=args.timeout)
    except TransportError as exc:
        raise Unreachable(str(exc)) from None
    except TimeoutError:
        raise Unreachable(f"the genie master at {host}:{port} did not answer within {args.timeout:g} s") from None


def operator_command(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn :class:`Unreachable` into one line on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except Unreachable as exc:
            print(f"genie {args.command}: error: {exc}", file=sys.stderr)
            return UNREACHABLE

    return wrapper
