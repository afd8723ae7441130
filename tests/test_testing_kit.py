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


def test_a_node_silent_past_its_wait_is_reported_with_its_cpu_the_host_and_its_stacks() -> None:
    """A real ``genie serve`` given 0.3 s: it is still importing torch, so the error says what it was doing."""
    from genie.cluster.launch import NodeProcess
    from genie.errors import GenieError

    node = NodeProcess("serve", "--port", "0", "--devices", "cpu", ready_timeout=0.3)
    with pytest.raises(GenieError) as caught:
        node.start()
    text = str(caught.value)
    assert "did not become ready within 0.3 s (still running after" in text and "s of CPU, load " in text
    assert "MiB available" in text and "Current thread" in text, text[-2000:]
    assert not node.alive()


def test_a_node_that_exits_before_its_ready_line_is_reported_with_its_exit_code() -> None:
    from genie.cluster.launch import NodeProcess
    from genie.errors import GenieError

    with pytest.raises(GenieError, match=r"did not become ready within \S+ s \(exited with 2\)"):
        NodeProcess("serve", "--no-such-option").start()
