"""The extension points scheduler plugins (genie-ray) use, against a real master process:
``scheme://`` master addresses (genie_resolve_master, ``genie.init(NAME=True)``), subcommands
from plugins (genie_cli_commands), and an outside failure detector marking a node lost at once
(Membership.mark_lost, ControlService.declare_lost)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import genie
from genie.cli import main as genie_main
from genie.cli._master import master_address
from genie.cluster.launch import NodeProcess
from genie.cluster.membership import Membership
from genie.errors import ConfigError
from genie.plugins import get_plugin_manager
from genie.types import EventType, GPUInfo, NodeInfo, NodeRole, NodeStatus


class LabResolver:
    """Resolves ``lab://...`` to one real master and records what it was asked."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.asked: list[tuple[str, float]] = []

    @genie.hookimpl
    def genie_resolve_master(self, address: str, timeout: float) -> tuple[str, int] | None:
        if not address.startswith("lab://"):
            return None
        self.asked.append((address, timeout))
        return "127.0.0.1", self.port


@pytest.fixture
def lab(cpu_server: NodeProcess) -> Iterator[LabResolver]:
    resolver = LabResolver(cpu_server.control_port)
    get_plugin_manager().register(resolver, name="lab-resolver")
    try:
        yield resolver
    finally:
        get_plugin_manager().unregister("lab-resolver")


def test_init_with_a_scheme_shorthand_or_address_reaches_the_master_the_plugin_names(lab: LabResolver) -> None:
    state = genie.init_sync(lab=True, timeout=20, connect_timeout=3)
    try:
        assert (state.config.master_addr, state.config.master_port) == ("127.0.0.1", lab.port)
        assert torch.ones(3, device="remote_accelerator:0").sum().item() == 3.0
    finally:
        genie.shutdown_sync()
    state = genie.init_sync(master_addr="lab://rack7", timeout=20)
    try:
        assert state.config.master_port == lab.port
    finally:
        genie.shutdown_sync()
    assert lab.asked == [("lab://", 3.0), ("lab://rack7", 5.0)]
    # The operator commands' --master goes through the same lookup.
    assert master_address(argparse.Namespace(master="lab://x")) == ("127.0.0.1", lab.port)


def test_a_scheme_no_plugin_resolves_is_a_config_error_naming_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"no installed plugin resolves nope:// addresses.*genie-nope"):
        genie.init_sync(master_addr="nope://somewhere", timeout=5)
    with pytest.raises(ConfigError, match=r"genie-nope"):
        genie.init_sync(nope=True, timeout=5)
    # Only NAME=True is the shorthand: any other unknown option stays an unknown option.
    with pytest.raises(ConfigError, match=r"'nope'"):
        genie.init_sync(nope=1, timeout=5)
    assert not genie.is_initialized()


def test_plugins_add_subcommands_and_may_not_take_the_cores(capsys: pytest.CaptureFixture[str]) -> None:
    class Hello:
        @genie.hookimpl
        def genie_cli_commands(self) -> list[Any]:
            def register(sub: Any) -> None:
                p = sub.add_parser("hello", help="say hello")
                p.add_argument("--to", default="world")
                p.set_defaults(func=lambda args: print(f"hello {args.to}") or 7)
            return [register]

    class Thief:
        @genie.hookimpl
        def genie_cli_commands(self) -> list[Any]:
            return [lambda sub: sub.add_parser("status")]

    pm = get_plugin_manager()
    pm.register(Hello(), name="hello-plugin")
    try:
        assert genie_main(["hello", "--to", "ray"]) == 7
        assert capsys.readouterr().out == "hello ray\n"
        pm.register(Thief(), name="thief-plugin")
        try:
            assert genie_main(["status"]) == 1
            assert "thief-plugin" in capsys.readouterr().err
        finally:
            pm.unregister("thief-plugin")
    finally:
        pm.unregister("hello-plugin")


def _node(node_id: str, role: NodeRole, gpus: int = 1) -> NodeInfo:
    return NodeInfo(node_id, "host", role, "127.0.0.1", 1234, tuple(GPUInfo(i, f"cpu{i}", "cpu") for i in range(gpus)))


def test_mark_lost_declares_a_connected_serving_node_lost_once_until_it_rejoins() -> None:
    membership = Membership(heartbeat_timeout=60.0, self_id="m")
    membership.join(_node("m", NodeRole.SERVER))
    membership.join(_node("w1", NodeRole.WORKER, gpus=2))
    membership.join(_node("c1", NodeRole.CLIENT, gpus=0))
    version = membership.version
    [event] = membership.mark_lost("w1", "the scheduler says its host died")
    assert (event.type, event.source, event.data["reason"]) == (EventType.NODE_LOST, "w1",
                                                                "the scheduler says its host died")
    assert membership.members["w1"].status == NodeStatus.LOST and membership.version == version + 1
    assert [m.info.node_id for m in membership.changed_since(version)] == ["w1"]
    # Already lost, the master itself, a client, a stranger: nothing happens.
    for node_id in ("w1", "m", "c1", "nobody"):
        assert membership.mark_lost(node_id, "again") == []
    assert [d["status"] for d in membership.devices() if d["node_id"] == "w1"] == ["lost", "lost"]
    # Its process may outlive the verdict by seconds: its heartbeats do not bring it back; a rejoin does.
    assert membership.heartbeat("w1", None) == [] and membership.members["w1"].status == NodeStatus.LOST
    [back] = membership.join(_node("w1", NodeRole.WORKER, gpus=2))
    assert back.type == EventType.NODE_RECOVERED and membership.members["w1"].status == NodeStatus.CONNECTED
    # A node lost by heartbeat timeout is not fenced: its next heartbeat recovers it, as before.
    membership.members["w1"].last_seen -= 120
    [lost] = membership.sweep()
    assert lost.type == EventType.NODE_LOST
    [again] = membership.heartbeat("w1", None)
    assert again.type == EventType.NODE_RECOVERED
