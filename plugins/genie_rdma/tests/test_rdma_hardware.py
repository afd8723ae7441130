"""Hardware-only paths of genie-rdma: verbs (an RDMA NIC) and GPUDirect RDMA (CUDA memory as NIXL regions).

Both skip here, naming the hardware they need; they run where it exists (the GPU
machine when one is lent: CUDA regions between two processes on one GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="NIXL is not installed: pip install --no-deps nixl-cu12==1.5.1 numpy")

from genie_rdma.transport import RdmaTransport  # noqa: E402

from genie.transport.conformance import TransportConformance  # noqa: E402


def _rdma_devices() -> bool:
    try:
        return any(Path("/sys/class/infiniband").iterdir())
    except OSError:
        return False


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _rdma_devices(), reason="hardware only: needs an RDMA NIC (/sys/class/infiniband)")
class TestRdmaOverVerbsConformance(TransportConformance):
    """UCX picks verbs when a device exists and UCX_TLS is not narrowed."""

    transport_class = RdmaTransport


PEER = textwrap.dedent("""
    import sys, torch
    from genie_rdma.transport import RdmaTransport
    from genie.transport.base import bulk_path, handshake_complete
    n = 16 << 20
    if sys.argv[1] == "serve":
        listener = RdmaTransport().listen("127.0.0.1", 0)
        print(listener.port, flush=True)
        channel = listener.accept(timeout=60)
        channel.settimeout(60)
        target = torch.empty(n, dtype=torch.uint8, device="cuda")
        bulk = bulk_path(channel)
        bulk.recv_region(bulk.register(target))                  # straight into GPU memory
        expected = (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)
        print("equal", bool(torch.equal(target.cpu(), expected)), flush=True)
        channel.recv_into(memoryview(bytearray(1)))
    else:
        channel = RdmaTransport().connect("127.0.0.1", int(sys.argv[2]), timeout=30)
        channel.settimeout(60)
        handshake_complete(channel, {})
        source = (torch.arange(n, dtype=torch.int64, device="cuda") % 251).to(torch.uint8)
        bulk = bulk_path(channel)
        bulk.send_region(bulk.register(source))                   # straight from GPU memory
        channel.sendv([b"!"])
        print("sent", flush=True)
""")


@pytest.mark.skipif(not _cuda(), reason="hardware only: needs a CUDA GPU (GPUDirect / CUDA memory as NIXL regions)")
def test_cuda_regions_cross_between_two_processes_on_one_gpu():
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "cuda_copy,cuda_ipc,tcp")}
    server = subprocess.Popen([sys.executable, "-c", PEER, "serve"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        assert port.isdigit(), server.stderr.read() if server.stderr else ""
        client = subprocess.run([sys.executable, "-c", PEER, "connect", port], capture_output=True, text=True,
                                timeout=180, env=env)
        assert client.returncode == 0 and "sent" in client.stdout, client.stderr
        out, err = server.communicate(timeout=60)
        assert "equal True" in out, out + err
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
