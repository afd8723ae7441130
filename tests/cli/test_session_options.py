"""``genie serve``, ``genie worker`` and ``python -m genie.server`` share one definition of the
session options (genie.cli.options); every command that talks to a master takes ``GENIE_MASTER_*``."""

from __future__ import annotations

import argparse

import pytest

from genie.cli import build_parser
from genie.cli.options import SESSION_OPTIONS, session_config
from genie.server.__main__ import add_arguments

FLAGS = ["--devices", "cpu,cpu", "--node-id", "n7", "--insecure", "--cache-bytes", "4096", "--share-cache",
         "--isolation", "none", "--op-deadline", "12.5", "--cuda-mps",
         "--compile-replays", "inductor", "--profile-sessions", "/var/tmp/genie-profiles"]
EXPECTED = {"devices": "cpu,cpu", "node_id": "n7", "insecure": True, "cache_bytes": 4096, "share_cache": True,
            "isolation": "none", "op_deadline": 12.5, "cuda_mps": True,
            "compile_replays": "inductor", "profile_sessions": "/var/tmp/genie-profiles"}


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


@pytest.mark.parametrize("command", ["status", "health", "metrics", "events", "dashboard", "plugins", "discover"])
def test_every_command_that_talks_to_a_master_takes_GENIE_MASTER_variables_and_the_argument_wins(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13: only ``--master`` used to work for some commands. The master each command would reach,
    from the environment and from ``--master`` given too (``genie worker``: tests/cluster/test_growth.py;
    a real unreachable master from the environment: test_operator_cli.py)."""
    from genie.cli._master import master_address
    from genie.cli.discover import target_from_args
    from genie.config import ClusterConfig

    def reached(argv: list[str]) -> tuple[str, int]:
        args = build_parser().parse_args([command, *argv])
        if command in ("plugins", "discover"):  # they probe the master (or only local capabilities)
            target = target_from_args(args, ClusterConfig.from_sources())
            return target.host, target.port
        return master_address(args)

    monkeypatch.setenv("GENIE_MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("GENIE_MASTER_PORT", "6123")
    assert reached([]) == ("10.1.2.3", 6123)
    assert reached(["--master", "10.9.9.9:7000"]) == ("10.9.9.9", 7000)
