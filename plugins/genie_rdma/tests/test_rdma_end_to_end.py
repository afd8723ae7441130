"""A real `genie serve` process and a client doing remote tensor work over rdma (NIXL over UCX tcp).

Both ends name the backend (``GENIE_BACKEND=rdma``) and run UCX over tcp (no RDMA
NIC here); a 64 MiB tensor goes up and comes back by RDMA READs. Public API only.
"""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("nixl_cu12", reason="NIXL is not installed: pip install --no-deps nixl-cu12==1.5.1 numpy")

from genie.cluster.launch import NodeProcess  # noqa: E402
from genie.testing import run_client  # noqa: E402

ENV = {"GENIE_BACKEND": "rdma", "UCX_TLS": "tcp"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_remote_tensor_work_runs_over_rdma():
    with NodeProcess("serve", "--port", str(_free_port()), "--devices", "cpu", env=ENV) as server:
        result = run_client(server.control_port, """
            assert state.backend == "rdma", state.backend
            a = torch.randn(128, 128)
            ra = a.to("remote_accelerator:0")
            assert torch.allclose((ra @ ra).cpu(), a @ a, atol=1e-4)
            big = torch.arange(16 << 20, dtype=torch.float32)          # 64 MiB: RDMA READs both ways
            assert torch.equal((big.to("remote_accelerator:0") + 1).cpu(), big + 1)
            print("OK", state.backend)
        """, env=ENV)
        assert result.returncode == 0, result.stdout + result.stderr + server.log()[-3000:]
        assert "OK rdma" in result.stdout


def test_explicit_rdma_without_a_way_to_run_fails_with_the_reason(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    with NodeProcess("serve", "--port", str(_free_port()), "--devices", "cpu") as server:
        result = run_client(server.control_port, "print('unexpected')", env={"GENIE_BACKEND": "rdma"})
    assert result.returncode != 0 and "unexpected" not in result.stdout
    assert "backend 'rdma' was requested" in result.stderr and "rdma: unavailable" in result.stderr
