"""A cluster that grows while clients use it, with the client's own security settings, and the
``GENIE_MASTER_*`` variables for every command. Real node processes on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from genie.cluster.launch import NodeProcess
from genie.testing import refused_port, wait_until
from tests.cluster.conftest import HB, HB_INIT, node_status, run_genie

TOKEN = "growth-test-token"


def test_a_worker_that_joins_after_init_is_appended_at_the_end_and_usable() -> None:
    import torch

    import genie
    from genie.types import EventType

    added: list = []
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "master", *HB) as master:
        port = master.control_port
        genie.init_sync(master_addr="127.0.0.1", master_port=port, **HB_INIT)
        try:
            genie.subscribe(added.append, types=[EventType.DEVICES_ADDED])
            # torch.remote_accelerator is registered at run time: torch's stubs cannot know it
            assert torch.remote_accelerator.device_count() == 1  # type: ignore[attr-defined]
            before = torch.arange(3.0).to("remote_accelerator:0")
            with NodeProcess("worker", "--master", f"127.0.0.1:{port}", "--devices", "cpu,cpu", "--node-id", "late",
                             *HB):
                wait_until(lambda: added, 5)
                assert added[0].source == "late" and added[0].data["devices"] == [1, 2]
                assert torch.remote_accelerator.device_count() == 3  # type: ignore[attr-defined]
                state = genie.get_cluster_state()
                assert [d["node_id"] for d in state.devices] == ["master", "late", "late"]
                assert "late" in {n["node_id"] for n in state.nodes}
                on_late = torch.full((3,), 2.0, device="remote_accelerator:2")
                assert (on_late * 2).sum().item() == 12.0
                torch.testing.assert_close(before.to("remote_accelerator:1").cpu(), torch.arange(3.0))
                assert before.sum().item() == 3.0  # index 0 and its tensors are untouched
        finally:
            genie.shutdown_sync()


def test_the_event_relay_and_new_sessions_use_the_token_given_to_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token is passed only as genie.init(auth_token=...): the relay must still see node_lost."""
    import torch

    import genie
    from genie.types import EventType

    monkeypatch.delenv("GENIE_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("GENIE_AUTH_TOKEN_FILE", raising=False)
    secured = {"GENIE_AUTH_TOKEN": TOKEN}
    seen: list = []
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "master", *HB, env=secured) as master:
        port = master.control_port
        genie.init_sync(master_addr="127.0.0.1", master_port=port, auth_token=TOKEN, **HB_INIT)
        try:
            genie.subscribe(seen.append, types=[EventType.NODE_JOINED, EventType.NODE_LOST,
                                                EventType.DEVICES_ADDED])
            worker = NodeProcess("worker", "--master", f"127.0.0.1:{port}", "--devices", "cpu", "--node-id", "w",
                                 *HB, env=secured).start()
            try:
                # node_joined comes through the relay (from the master), devices_added from this
                # client's own session to the new node: both need the token.
                wait_until(lambda: {(e.type, e.source) for e in seen} >= {(EventType.NODE_JOINED, "w"),
                                                                          (EventType.DEVICES_ADDED, "w")}, 5)
                assert torch.ones(2, device="remote_accelerator:1").sum().item() == 2.0
                worker.kill()
                wait_until(lambda: any(e.type == EventType.NODE_LOST and e.source == "w" for e in seen), 5)
            finally:
                worker.stop()
                worker.cleanup()
        finally:
            genie.shutdown_sync()


@pytest.fixture(scope="module")
def plain_master() -> Iterator[NodeProcess]:
    """A master without a token, shared by the tests that only point commands and workers at it (nobody
    counts its devices)."""
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "master", *HB) as master:
        yield master


def test_genie_worker_finds_the_master_through_GENIE_MASTER_variables_and_arguments_win(
        plain_master: NodeProcess) -> None:
    with refused_port() as nowhere:
        port = plain_master.control_port
        to_master = {"GENIE_MASTER_ADDR": "127.0.0.1", "GENIE_MASTER_PORT": str(port)}
        elsewhere = {"GENIE_MASTER_ADDR": "127.0.0.1", "GENIE_MASTER_PORT": str(nowhere)}
        with NodeProcess("worker", "--devices", "cpu", "--node-id", "by-env", *HB, env=to_master), \
                NodeProcess("worker", "--master", f"127.0.0.1:{port}", "--devices", "cpu", "--node-id", "by-arg",
                            *HB, env=elsewhere):
            wait_until(lambda: node_status(port, "by-env") == "connected"
                       and node_status(port, "by-arg") == "connected", 5)


def test_genie_discover_probes_the_master_of_GENIE_MASTER_variables_unless_told_otherwise(
        plain_master: NodeProcess) -> None:
    with refused_port() as other:
        port = plain_master.control_port
        env = {"GENIE_MASTER_ADDR": "127.0.0.1", "GENIE_MASTER_PORT": str(port)}
        by_env = run_genie("discover", "--json", env=env)
        assert by_env.returncode == 0, by_env.stderr
        target = json.loads(by_env.stdout)["target"]
        assert (target["host"], target["port"]) == ("127.0.0.1", port)
        by_arg = json.loads(run_genie("discover", "--json", "--master", f"127.0.0.1:{other}", env=env).stdout)
        assert by_arg["target"]["port"] == other
