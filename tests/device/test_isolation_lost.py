"""A session whose worker is killed: the genie client raises RemoteDeviceLost naming why (issue 11).

A real ``genie serve`` node with ``--op-deadline 1`` and a real client process; the op is
real runaway work (a sum over 2**40 expanded elements), killed by the node at its deadline.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from genie.cluster.launch import NodeProcess
from genie.testing import run_client


@pytest.fixture(scope="module")
def strict_node() -> Iterator[NodeProcess]:
    # GENIE_MAX_OP_ELEMENTS=0: no pre-flight element cap, so the runaway sum runs until the deadline
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--op-deadline", "1",
                     env={"GENIE_MAX_OP_ELEMENTS": "0"}) as node:
        yield node


def test_the_serve_line_says_how_sessions_are_isolated(strict_node: NodeProcess) -> None:
    assert "isolation: process, " in strict_node.log()


def test_an_op_past_the_deadline_raises_remote_device_lost_naming_the_op(strict_node: NodeProcess) -> None:
    result = run_client(strict_node.control_port, """
        from genie.errors import RemoteDeviceLost
        x = torch.ones(1, device="remote_accelerator:0")
        try:
            x.expand(2 ** 40).sum().item()
        except RemoteDeviceLost as exc:
            print("LOST:", exc)
    """, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOST:" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "session worker killed: deadline of 1 s exceeded by aten::sum" in result.stdout


def test_the_node_serves_the_next_client_after_a_worker_was_killed(strict_node: NodeProcess) -> None:
    result = run_client(strict_node.control_port, """
        x = torch.arange(4.0, device="remote_accelerator:0")
        print("SUM", (x * 2).sum().item())
    """, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SUM 12.0" in result.stdout
