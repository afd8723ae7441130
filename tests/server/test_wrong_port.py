"""A client pointed at a node's data port instead of a master hears what it did wrong."""

from __future__ import annotations

import pytest

import genie
from genie.cluster.launch import NodeProcess
from genie.errors import HandshakeError


def test_init_against_a_data_port_names_the_mistake_and_the_fix(genie_serve: NodeProcess) -> None:
    with pytest.raises(HandshakeError) as info:
        genie.init_sync(master_addr="127.0.0.1", master_port=genie_serve.port, timeout=10)
    message = str(info.value)
    assert "data port" in message and "not a master" in message and "master_port" in message, message
    assert "torch None" not in message
    # Nothing was left behind: a real init works afterwards in the same process (no AlreadyInitializedError).
    assert genie.is_initialized() is False
