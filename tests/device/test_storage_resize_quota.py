"""A storage regrown past the node's session byte quota (``max_session_bytes``): the node refuses the
``CMD_RESIZE`` queued with the ops, and the client raises at its next sync point, naming the limit and the fix.
A node of its own (the shared server has no quota), this process its client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import genie
from genie.cluster.launch import NodeProcess
from genie.errors import QuotaExceededError

D0 = "remote_accelerator:0"


@pytest.fixture(scope="module")
def quota_node() -> Iterator[NodeProcess]:
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--heartbeat-interval", "0.2",
                     "--heartbeat-timeout", "2", env={"GENIE_MAX_SESSION_BYTES": str(1 << 20)}) as node:
        genie.init_sync(master_addr="127.0.0.1", master_port=node.control_port, heartbeat_interval=0.2,
                        heartbeat_timeout=2, timeout=20)
        try:
            yield node
        finally:
            genie.shutdown_sync()


def test_a_regrow_past_the_session_quota_fails_at_the_next_sync_point_naming_the_fix(quota_node: NodeProcess) -> None:
    a = torch.ones(160_000, device=D0)  # 640 kB of the session's 1 MiB
    a.untyped_storage().resize_(0)  # the node lets go of them...
    b = torch.ones(160_000, device=D0)  # ... so these fit
    assert b.sum().item() == 160_000
    a.untyped_storage().resize_(640_000)  # queued like an op: the node refuses it, past the quota
    with pytest.raises(QuotaExceededError) as refused:
        b.sum().item()
    message = str(refused.value)
    assert message.startswith("remote resize") and "max_session_bytes" in message, message
    assert "free tensors you no longer need" in message
    assert b.sum().item() == 160_000  # the session goes on
