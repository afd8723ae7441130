"""genie.init / shutdown as a user meets them: errors, timeouts, idempotence, exit without shutdown."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import genie
from genie.errors import AlreadyInitializedError, ConfigError, ConnectError, InitTimeoutError, NotInitializedError
from genie.testing import same_host_backends
from tests.conftest import refused_port


def test_shutdown_without_init_is_a_no_op_and_state_needs_init() -> None:
    genie.shutdown_sync()
    assert not genie.is_initialized()
    with pytest.raises(NotInitializedError, match="genie.init"):
        genie.get_cluster_state()


def test_bad_configuration_is_a_config_error_naming_the_option() -> None:
    with pytest.raises(ConfigError, match="70000.*master_port.*argument master_port"):
        genie.init_sync(master_addr="127.0.0.1", master_port=70000)
    with pytest.raises(ConfigError, match="node_role"):
        genie.init_sync(master_addr="127.0.0.1", node_role="boss")
    assert not genie.is_initialized()


def test_unreachable_master_fails_fast_with_a_clear_message() -> None:
    with refused_port() as port, pytest.raises(ConnectError, match=f"cannot reach the genie master at 127.0.0.1:{port}"):
        # fast: a refused connection fails the discovery phase, long before init's 30 s timeout
        genie.init_sync(master_addr="127.0.0.1", master_port=port, timeout=30)
    assert not genie.is_initialized()


def test_a_master_that_never_answers_times_out_naming_the_phase() -> None:
    with socket.socket() as silent:  # accepts connections, never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(InitTimeoutError, match="phase 'connect'"):
            genie.init_sync(master_addr="127.0.0.1", master_port=port, timeout=1.0, connect_timeout=0.5)
        assert time.monotonic() - t0 < 3
    assert not genie.is_initialized()


def test_init_twice_is_refused_and_async_api_works_from_an_asyncio_loop(cpu_server) -> None:
    async def main() -> None:
        state = await genie.init(master_addr="127.0.0.1", master_port=cpu_server.control_port, timeout=20)
        try:
            assert genie.is_initialized()
            assert genie.get_cluster_state() is state
            assert set(state.phase_durations) == {"config", "local_node", "discovery", "connect", "monitoring"}
            # Client and server share this host: shm when genie-shm is installed, else dpdk (memif), else tcp.
            assert state.backend == same_host_backends()[0]
            with pytest.raises(AlreadyInitializedError):
                await genie.init(master_addr="127.0.0.1", master_port=cpu_server.control_port)
        finally:
            await genie.shutdown()
        assert not genie.is_initialized()

    if genie.is_initialized():
        pytest.skip("a session-wide init is active in this process")
    asyncio.run(main())


def test_interpreter_exit_without_shutdown_does_not_hang(cpu_server) -> None:
    script = textwrap.dedent(f"""
        import torch, genie
        genie.init_sync(master_addr="127.0.0.1", master_port={cpu_server.control_port})
        x = torch.ones(3, device="remote_accelerator:0")
        print(x.sum().item())
    """)
    # The bound is the timeout: a hang at exit would raise TimeoutExpired.
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3.0"
