"""The cluster token on the control plane (JOIN, QUERY, SUBSCRIBE) and genie.init end to end, against real nodes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import anyio
import pytest

from genie.cluster.launch import NodeProcess
from genie.cluster.query import query_master_sync
from genie.config import ClusterConfig
from genie.errors import AuthenticationError
from genie.wire import control
from genie.wire.frame import MsgKind
from tests.security.conftest import TOKEN

HB = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2")
#: The environment of a child that must not inherit this process's GENIE_* settings.
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}


def node(*args: str, env: dict[str, str], ready_timeout: float = 60.0) -> NodeProcess:
    """A node process whose environment is exactly ``env`` plus this one's non-GENIE variables."""
    proc = NodeProcess(*args, ready_timeout=ready_timeout)
    proc.env = {**CLEAN_ENV, **env}
    return proc


@pytest.fixture(scope="module")
def master() -> Iterator[NodeProcess]:
    """A `genie serve` with a cluster token and two CPU devices."""
    with node("serve", "--port", "0", "--devices", "cpu,cpu", "--node-id", "sec-master", *HB,
              env={"GENIE_AUTH_TOKEN": TOKEN}) as proc:
        yield proc


def cfg(**options: object) -> ClusterConfig:
    return ClusterConfig.from_sources({}, **options)


def test_query_with_the_right_token_works(master):
    snap = query_master_sync("127.0.0.1", master.control_port, config=cfg(auth_token=TOKEN))
    assert [n["node_id"] for n in snap["nodes"]] == ["sec-master"]


@pytest.mark.parametrize("options", [{}, {"auth_token": "wrong"}], ids=["missing", "wrong"])
def test_query_without_the_right_token_is_refused_and_logged(master, options):
    with pytest.raises(AuthenticationError, match="wrong or missing cluster token; set GENIE_AUTH_TOKEN"):
        query_master_sync("127.0.0.1", master.control_port, config=cfg(**options))
    deadline = time.monotonic() + 5
    while "refused control connection" not in master.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "refused control connection" in master.log()


def test_unauthenticated_messages_are_refused_before_anything_is_served(master):
    async def main() -> tuple[MsgKind, dict]:
        async with await anyio.connect_tcp("127.0.0.1", master.control_port) as stream:
            await control.send_msg(stream, MsgKind.QUERY, {})
            return await control.recv_msg(stream)

    kind, body = anyio.run(main)
    assert kind == MsgKind.REJECT and body["code"] == "auth" and "nodes" not in body


def test_worker_joins_with_the_token_and_not_without(master):
    args = ("worker", "--master", f"127.0.0.1:{master.control_port}", "--devices", "cpu", *HB)
    with node(*args, "--node-id", "sec-worker", env={"GENIE_AUTH_TOKEN": TOKEN}):
        snap = query_master_sync("127.0.0.1", master.control_port, config=cfg(auth_token=TOKEN))
        assert {n["node_id"] for n in snap["nodes"]} == {"sec-master", "sec-worker"}
    with pytest.raises(Exception, match="wrong or missing cluster token"):
        with node(*args, "--node-id", "bad-worker", env={"GENIE_AUTH_TOKEN": "nope"}, ready_timeout=20):
            pass


INIT_SCRIPT = textwrap.dedent("""
    import sys, torch, genie
    from genie.errors import AuthenticationError
    try:
        genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=20)
    except AuthenticationError as exc:
        print("AUTH-REFUSED", exc)
        sys.exit(3)
    x = torch.arange(6.0).to("remote_accelerator:1")
    print("RESULT", (x * 2).sum().item())
    genie.shutdown_sync()
""")


def run_init(port: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", INIT_SCRIPT, str(port)], env={**CLEAN_ENV, **env},
                          capture_output=True, text=True, timeout=60)


def test_genie_init_end_to_end_with_GENIE_AUTH_TOKEN(master):
    done = run_init(master.control_port, {"GENIE_AUTH_TOKEN": TOKEN})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT 30.0" in done.stdout


def test_genie_init_with_a_wrong_token_fails_with_AuthenticationError(master):
    done = run_init(master.control_port, {"GENIE_AUTH_TOKEN": "wrong"})
    assert done.returncode == 3, done.stdout + done.stderr
    assert "wrong or missing cluster token; set GENIE_AUTH_TOKEN" in done.stdout


def test_token_is_not_in_the_server_output_nor_on_the_control_wire(master, recording_proxy):
    proxy = recording_proxy(master.control_port)
    query_master_sync("127.0.0.1", proxy.port, config=cfg(auth_token=TOKEN))
    with pytest.raises(AuthenticationError):
        query_master_sync("127.0.0.1", proxy.port, config=cfg(auth_token=TOKEN + "x"))
    assert b"sec-master" in proxy.recorded  # the capture saw the reply
    assert TOKEN.encode() not in proxy.recorded
    assert TOKEN not in master.log()
