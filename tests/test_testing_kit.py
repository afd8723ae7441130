"""genie.testing, the kit plugin authors use too: its helpers do what they promise."""

from __future__ import annotations

import socket

import pytest

from genie.testing import refused_port, wait_until


def test_refused_port_refuses_connections_while_held() -> None:
    with refused_port() as port:
        assert port != 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        with socket.socket() as other, pytest.raises(OSError):  # nobody else can take it meanwhile
            other.bind(("127.0.0.1", port))


def test_wait_until_returns_the_first_true_value_and_names_what_never_came() -> None:
    answers = iter([0, None, "ready"])
    assert wait_until(lambda: next(answers), 1, step=0) == "ready"
    with pytest.raises(AssertionError, match="the master's answer not met within 0.05 s"):
        wait_until(lambda: False, 0.05, what="the master's answer")


def test_genie_inproc_server_binds_port_0_and_serves(genie_inproc_server) -> None:
    server = genie_inproc_server(devices=1)
    assert server.port != 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=2):
        pass
