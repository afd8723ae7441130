"""``genie serve``, ``genie worker`` and ``python -m genie.server`` share one definition of the
session options (genie.cli.options): the same flags, turned into the same configuration."""

from __future__ import annotations

import argparse

import pytest

from genie.cli import build_parser
from genie.cli.options import SESSION_OPTIONS, session_config
from genie.server.__main__ import add_arguments

FLAGS = ["--devices", "cpu,cpu", "--node-id", "n7", "--insecure", "--cache-bytes", "4096", "--share-cache",
         "--isolation", "none", "--op-deadline", "12.5"]
EXPECTED = {"devices": "cpu,cpu", "node_id": "n7", "insecure": True, "cache_bytes": 4096, "share_cache": True,
            "isolation": "none", "op_deadline": 12.5}


def bare_server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m genie.server")
    add_arguments(parser)
    return parser


@pytest.mark.parametrize("parse", [
    lambda flags: build_parser().parse_args(["serve", *flags]),
    lambda flags: build_parser().parse_args(["worker", *flags]),
    lambda flags: bare_server_parser().parse_args(flags),
], ids=["genie serve", "genie worker", "python -m genie.server"])
def test_every_command_that_serves_sessions_takes_the_session_options_into_its_config(parse) -> None:
    config = session_config(parse(FLAGS))
    assert {name: getattr(config, name) for name in SESSION_OPTIONS} == EXPECTED
    assert all(config.sources[name].startswith("argument") for name in SESSION_OPTIONS)


def test_a_session_option_left_out_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENIE_ISOLATION", "none")
    monkeypatch.setenv("GENIE_OP_DEADLINE", "7")
    config = session_config(bare_server_parser().parse_args([]))
    assert (config.isolation, config.op_deadline) == ("none", 7.0)
    assert session_config(bare_server_parser().parse_args(["--isolation", "process"])).isolation == "process"
