"""genie-rdma's NIXL data path passes the transport conformance suite over UCX tcp and shared memory.

No RDMA NIC here: UCX carries the same one-sided READs over its tcp and shared-memory
transports (UCX_TLS, set per class in a child-free way: UCX reads it when each agent starts).
The verbs and GPUDirect paths are hardware-only (test_rdma_hardware.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu12", reason="NIXL is not installed: pip install --no-deps nixl-cu12==1.5.1 numpy")

from genie_rdma.transport import RdmaTransport  # noqa: E402

from genie.transport.conformance import TransportConformance  # noqa: E402


@pytest.fixture(autouse=True)
def _ucx_tls(request, monkeypatch):
    monkeypatch.setenv("UCX_TLS", request.cls.ucx_tls)


class TestRdmaOverUcxTcpConformance(TransportConformance):
    transport_class = RdmaTransport
    ucx_tls = "tcp"


class TestRdmaOverUcxSharedMemoryConformance(TransportConformance):
    transport_class = RdmaTransport
    ucx_tls = "shm,self"
