"""``genie --version``: the core and each plugin, with versions and paths."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from genie import _version
from genie._version import __version__
from genie.errors import GenieError
from genie.plugins import PluginManager


def version_lines(pm: PluginManager) -> list[str]:
    lines = [f"genie {__version__} at {os.path.dirname(os.path.abspath(_version.__file__))}"]
    for record in pm.records.values():
        if record.builtin:
            continue
        lines.append(f"  plugin {record.name}: {record.distribution} {record.version} at {record.path}")
    return lines


class VersionAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", 0)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        try:
            pm = PluginManager()
        except GenieError as exc:
            parser.exit(1, f"genie --version: error: {exc}\n")
        print("\n".join(version_lines(pm)))
        sys.exit(0)
