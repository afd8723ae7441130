"""The ``genie`` command.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a function
taking the parsed arguments and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from genie.errors import GenieError, PluginError

#: Subcommand modules, in the order ``genie --help`` lists them.
COMMANDS = ("plugins", "node", "discover", "status", "health", "metrics", "events", "dashboard")


def build_parser() -> argparse.ArgumentParser:
    from genie.cli.versions import VersionAction

    parser = argparse.ArgumentParser(prog="genie", description="Remote GPUs that feel local to PyTorch.")
    parser.add_argument("--version", action=VersionAction, help="show genie and every plugin with versions and paths")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"genie.cli.{name}").register(sub)
    _plugin_commands(sub)
    return parser


def _plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Subcommands plugins add (``genie_cli_commands``: ``genie ray`` from genie-ray). A plugin
    that fails to load costs its own commands, never the core's; ``genie plugins`` names it."""
    from genie.plugins import get_plugin_manager

    try:
        registers = get_plugin_manager().cli_commands()
    except GenieError as exc:
        # Not printed here: the command run next (genie plugins, init) names the broken plugin itself.
        logging.getLogger("genie.cli").debug("plugin subcommands are unavailable: %s", exc)
        return
    for plugin_name, register in registers:
        try:
            register(sub)
        except argparse.ArgumentError as exc:
            raise PluginError(f"plugin {plugin_name!r} adds a subcommand genie already has: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    try:
        parser = build_parser()
    except GenieError as exc:  # a plugin's subcommand clashes with another's
        print(f"genie: error: {exc}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=(args.log_level or "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except GenieError as exc:
        print(f"genie {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
