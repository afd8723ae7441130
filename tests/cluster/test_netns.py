"""Nodes with their own addresses: master and worker in two network namespaces joined by a veth pair.

The namespaces, the veth pair and the 10.251.77.0/24 addresses are this test's own, made and removed
here; no traffic leaves them. Needs root and iproute2 (skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from genie.cluster.launch import NodeProcess

TOKEN = "netns-test-token-7f3a"
A, B = "10.251.77.1", "10.251.77.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = f"g{os.getpid() % 100000}"
    ns_a, ns_b = f"genie-{tag}-a", f"genie-{tag}-b"
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        _ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        _ip("link", "set", f"{tag}a", "netns", ns_a)
        _ip("link", "set", f"{tag}b", "netns", ns_b)
        for ns, dev, addr in ((ns_a, f"{tag}a", A), (ns_b, f"{tag}b", B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield ns_a, ns_b
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def in_ns(ns: str, role: str, *args: str) -> NodeProcess:
    node = NodeProcess(role, *args, env={"GENIE_AUTH_TOKEN": TOKEN})
    node.argv = ["ip", "netns", "exec", ns, *node.argv]
    return node


def test_master_worker_and_client_on_their_own_addresses(two_hosts) -> None:
    ns_a, ns_b = two_hosts
    hb = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2")
    with in_ns(ns_a, "serve", "--host", A, "--port", "5555", "--devices", "cpu", "--node-id", "master", *hb), \
            in_ns(ns_b, "worker", "--master", f"{A}:5555", "--host", B, "--devices", "cpu",
                  "--node-id", "worker-b", *hb):
        client = textwrap.dedent(f"""
            import torch, genie
            state = genie.init_sync(master_addr="{A}", master_port=5555, timeout=20)
            print("DEVICES", [(d["node_id"]) for d in state.devices])
            print("ADDRS", sorted(n["address"] for n in state.nodes if n["role"] != "client"))
            a = torch.arange(6.0).reshape(2, 3)
            for i in range(2):
                r = a.to(f"remote_accelerator:{{i}}")
                print("RESULT", i, (r * 2 + 1).sum().item())
            genie.shutdown_sync()
        """)
        out = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, "-c", client], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "GENIE_AUTH_TOKEN": TOKEN})
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        assert "DEVICES ['master', 'worker-b']" in lines
        assert f"ADDRS ['{A}', '{B}']" in lines
        assert "RESULT 0 36.0" in lines and "RESULT 1 36.0" in lines
