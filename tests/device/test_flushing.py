"""Adaptive batches: small right after a sync point, doubling while the server has work.

Real server process (the ``remote`` fixture). The test holds the session's lock while it queues,
so the runtime's idle flusher (which only tries the lock) cannot send a batch in between.
"""

from __future__ import annotations

import pytest
import torch

from genie.device import connection
from genie.device.registry import table

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


def test_batches_start_small_after_a_sync_and_double_up_to_the_maximum() -> None:
    conn = table().get(0).connection
    x = torch.zeros(4, device=D0)
    x.sum().item()  # a sync point: the server is idle
    assert conn.flush_at == connection.MIN_BATCH_CMDS
    queued = 0
    with conn.lock:
        sizes: list[int] = []
        bound = connection.MIN_BATCH_CMDS
        while bound <= connection.MAX_BATCH_CMDS and len(sizes) < 8:
            before = conn.stats["batches"]
            for i in range(bound):
                assert conn.stats["batches"] == before, f"a batch went out after {i} of {bound} ops"
                x = x + 1
                queued += 1
            assert conn.stats["batches"] == before + 1
            sizes.append(bound)
            bound = conn.flush_at
            if sizes[-1] == connection.MAX_BATCH_CMDS:
                assert bound == connection.MAX_BATCH_CMDS
                break
    assert sizes[:3] == [connection.MIN_BATCH_CMDS * k for k in (1, 2, 4)]
    assert sizes[-1] == connection.MAX_BATCH_CMDS
    assert x[0].item() == queued  # every op ran, in order
    assert conn.flush_at == connection.MIN_BATCH_CMDS
