"""A real `genie serve` process and a client doing remote tensor work with backend="dpdk", public API only.

The server is started with ``--backend dpdk`` and the client with ``GENIE_BACKEND=dpdk``
(named explicitly: on this host ``auto`` would pick shm). Control frames cross on TCP,
tensors of 64 KiB and more in DPDK frames over memif (both processes on this host).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from genie_dpdk import engine

from genie.cluster.launch import NodeProcess
from genie.testing import run_client

pytestmark = pytest.mark.skipif(not engine.shim_built(), reason=engine.NO_SHIM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[NodeProcess]:
    with NodeProcess("serve", "--port", str(_free_port()), "--devices", "cpu", "--backend", "dpdk") as node:
        yield node


def test_remote_tensor_work_runs_over_dpdk(server: NodeProcess):
    result = run_client(server.control_port, """
        from genie_dpdk import engine
        assert state.backend == "dpdk", state.backend
        a = torch.randn(256, 256)
        b = torch.randn(256, 256)
        ra, rb = a.to("remote_accelerator:0"), b.to("remote_accelerator:0")
        assert torch.allclose((ra @ rb + 1).cpu(), a @ b + 1, atol=1e-4)
        big = torch.arange(4 << 20, dtype=torch.float32)          # 16 MiB: in DPDK frames
        back = (big.to("remote_accelerator:0") * 2).cpu()
        assert torch.equal(back, big * 2)
        assert abs(ra.sum().item() - a.sum().item()) < 1e-2
        assert engine.engine_running()                           # the polling thread, while the session lives
        sent, received = engine.bytes_moved()
        assert sent >= 16 << 20 and received >= 16 << 20, (sent, received)  # the big tensor, both ways
        print("OK", state.backend)
    """, env={"GENIE_BACKEND": "dpdk"}, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK dpdk" in result.stdout
    assert "DPDK upgrade" not in server.log()
