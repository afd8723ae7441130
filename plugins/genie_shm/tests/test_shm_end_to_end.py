"""A real `genie serve` process and a client doing remote tensor work over shm, through the public API only.

The server runs with genie-shm installed, so `auto` makes it listen with shm (which
also serves TCP clients); the client on the same host selects shm, and its tensors
cross through the server's memfd rings: the server process maps them (checked in
its /proc/PID/maps). With a wrong token no ring is ever handed over.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import pytest

from genie.cluster.launch import NodeProcess
from genie.testing import run_client, wait_until

TOKEN = "shm-e2e-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ring_maps(pid: int) -> int:
    """Rings mapped by the node ``pid`` and its processes (session workers serve the channels)."""
    import psutil

    total = 0
    node = psutil.Process(pid)
    for proc in [node, *node.children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/maps", encoding="utf-8") as f:
                total += sum("genie-shm-ring" in line for line in f)
        except (FileNotFoundError, ProcessLookupError):
            pass  # a worker that ended meanwhile maps nothing
    return total


@pytest.fixture(scope="module")
def server() -> Iterator[NodeProcess]:
    with NodeProcess("serve", "--port", str(_free_port()), "--devices", "cpu",
                     env={"GENIE_AUTH_TOKEN": TOKEN}) as node:
        yield node


def _client(server: NodeProcess, body: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    return run_client(server.control_port, body, env={"GENIE_AUTH_TOKEN": token})


def test_remote_tensor_work_runs_over_shm(server: NodeProcess):
    assert server.proc is not None
    result = _client(server, """
        assert state.backend == "shm", state.backend
        a = torch.randn(256, 256)
        b = torch.randn(256, 256)
        ra, rb = a.to("remote_accelerator:0"), b.to("remote_accelerator:0")
        assert torch.allclose((ra @ rb + 1).cpu(), a @ b + 1, atol=1e-4)
        big = torch.arange(16 << 20, dtype=torch.float32)          # 64 MiB: through the rings
        back = (big.to("remote_accelerator:0") * 2).cpu()
        assert torch.equal(back, big * 2)
        assert abs(ra.sum().item() - a.sum().item()) < 1e-2
        print("OK", state.backend)
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK shm" in result.stdout
    # The server mapped the client's ring and its own while the session lived.
    assert "shared-memory upgrade" not in server.log()


def test_server_maps_rings_only_for_authenticated_clients(server: NodeProcess):
    assert server.proc is not None
    before = _ring_maps(server.proc.pid)
    refused = _client(server, "print('unexpected')", token="wrong-token")
    assert refused.returncode != 0
    assert "unexpected" not in refused.stdout
    assert _ring_maps(server.proc.pid) == before, "a ring reached the server for a client it never authenticated"
    held = _client(server, f"""
        t = torch.ones(1024).to("remote_accelerator:0")
        assert t.sum().item() == 1024
        import psutil
        node = psutil.Process({server.proc.pid})
        maps = 0
        for proc in [node, *node.children(recursive=True)]:
            try:
                with open(f"/proc/{{proc.pid}}/maps") as f:
                    maps += sum("genie-shm-ring" in line for line in f)
            except FileNotFoundError:
                pass
        print("MAPS", maps)
    """)
    assert held.returncode == 0, held.stdout + held.stderr
    assert int(held.stdout.split("MAPS")[1]) >= 2  # its own ring (rw) and the client's (ro), at least
    # Ended sessions give their rings back at once (not when the garbage collector runs).
    pid = server.proc.pid
    wait_until(lambda: _ring_maps(pid) == 0, 10, step=0.05, what="the server unmapping the ended sessions' rings")
