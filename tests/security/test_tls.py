"""TLS on both planes: encrypted sessions, mutual TLS, and plain clients refused cleanly by TLS servers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from genie.cluster.launch import NodeProcess
from genie.cluster.query import query_master_sync
from genie.config import ClusterConfig
from genie.errors import AuthenticationError, HandshakeError
from genie.testing import wait_until
from tests.raw_client import desc
from tests.security.conftest import TOKEN

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_")}


def server_tls(pki, **extra: object) -> dict[str, object]:
    return {"tls_cert": pki.server_cert, "tls_key": pki.server_key, **extra}


def test_data_plane_over_tls_works_and_hides_the_tensors(dp_server, connect, recording_proxy, pki):
    server = dp_server(auth_token=TOKEN, **server_tls(pki))
    proxy = recording_proxy(server.port)
    conn = connect(proxy.port, auth_token=TOKEN, tls_ca=pki.ca)
    assert conn.channel.tls_version in ("TLSv1.2", "TLSv1.3")
    secret = torch.full((4096,), 1234.5678, dtype=torch.float64)
    conn.upload(1, 0, secret, overwrite=False)
    assert torch.equal(conn.fetch(0, desc(1, secret), torch.empty(4096, dtype=torch.float64)), secret)
    marker = secret[:8].numpy().tobytes()
    assert len(proxy.recorded) > 2 * secret.numel() * 8
    assert marker not in proxy.recorded and b"GN" not in proxy.recorded[:2]
    assert TOKEN.encode() not in proxy.recorded


def test_plain_client_is_refused_cleanly_by_a_tls_data_plane(dp_server, connect, pki, caplog):
    server = dp_server(**server_tls(pki))
    with caplog.at_level(logging.WARNING, "genie"), pytest.raises(HandshakeError, match="requires TLS; set GENIE_TLS_CA"):
        connect(server.port)
    assert "refused plain (non-TLS) connection" in caplog.text
    connect(server.port, tls_ca=pki.ca).sync()  # and TLS clients are still served


def test_tls_client_refuses_a_server_whose_certificate_it_cannot_verify(dp_server, connect, pki):
    server = dp_server(**server_tls(pki))
    with pytest.raises(HandshakeError, match="TLS handshake .* failed"):
        connect(server.port, tls_ca=pki.other_ca)
    plain = dp_server()
    with pytest.raises(HandshakeError, match="TLS handshake .* failed"):
        connect(plain.port, tls_ca=pki.ca)


def test_mutual_tls_requires_a_client_certificate(dp_server, connect, pki, caplog):
    server = dp_server(**server_tls(pki, tls_ca=pki.ca, tls_require_client_cert=True))
    # TLS 1.3 reports a missing client certificate on the client's first read, after its handshake.
    with caplog.at_level(logging.WARNING, "genie"), pytest.raises(HandshakeError, match="client certificate"):
        connect(server.port, tls_ca=pki.ca)
    # the server logs from its session thread, maybe after the client gave up
    wait_until(lambda: "TLS handshake with" in caplog.text, 5, what="the server's TLS handshake warning")
    conn = connect(server.port, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    conn.sync()


@pytest.fixture(scope="module")
def tls_master(pki) -> Iterator[NodeProcess]:
    proc = NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "tls-master",
                       "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2")
    proc.env = {**CLEAN_ENV, "GENIE_AUTH_TOKEN": TOKEN, "GENIE_TLS_CERT": pki.server_cert,
                "GENIE_TLS_KEY": pki.server_key, "GENIE_TLS_CA": pki.ca}
    with proc:
        yield proc


def test_control_plane_over_tls(tls_master, pki, recording_proxy):
    proxy = recording_proxy(tls_master.control_port)
    snap = query_master_sync("127.0.0.1", proxy.port,
                             config=ClusterConfig.from_sources({}, auth_token=TOKEN, tls_ca=pki.ca))
    assert [n["node_id"] for n in snap["nodes"]] == ["tls-master"]
    assert b"tls-master" not in proxy.recorded and len(proxy.recorded) > 500


def test_plain_query_is_refused_cleanly_by_a_tls_master(tls_master, pki):
    with pytest.raises(HandshakeError, match="requires TLS; set GENIE_TLS_CA"):
        query_master_sync("127.0.0.1", tls_master.control_port,
                          config=ClusterConfig.from_sources({}, auth_token=TOKEN))
    with pytest.raises(AuthenticationError):
        query_master_sync("127.0.0.1", tls_master.control_port,
                          config=ClusterConfig.from_sources({}, auth_token="wrong", tls_ca=pki.ca))
    assert "refused plain (non-TLS) control connection" in tls_master.log()


def test_genie_init_end_to_end_over_tls_with_a_token(tls_master, pki):
    script = ("import sys, torch, genie\n"
              "genie.init_sync(master_addr='127.0.0.1', master_port=int(sys.argv[1]), timeout=20)\n"
              "x = torch.arange(4.0).to('remote_accelerator:0')\n"
              "print('RESULT', (x + 1).sum().item(), genie.get_cluster_state().backend)\n"
              "genie.shutdown_sync()\n")
    env = {**CLEAN_ENV, "GENIE_AUTH_TOKEN": TOKEN, "GENIE_TLS_CA": pki.ca}
    done = subprocess.run([sys.executable, "-c", script, str(tls_master.control_port)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT 10.0" in done.stdout
