"""A node's own process on CPU devices never loads torch: only its session workers do (genie.server.host).

Real ``genie serve`` and ``genie worker`` processes and real clients; what a process has loaded is read from
``/proc/PID/maps`` (torch's shared library), so the check sees every import, however late.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

from genie.testing import LocalCluster, NodeProcess
from tests.conftest import unused_port

#: One client process: work on the master's device and on the worker's, and a model upload the weight cache keeps
#: (the second run of the script is a new session whose upload is a cache hit, answered by the node's process).
_CLIENT = r"""
import sys, torch, genie
genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=30)
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
for dev in ("remote_accelerator:0", "remote_accelerator:1"):
    x = torch.randn(64, 64)
    assert torch.allclose((x.to(dev) @ x.to(dev)).cpu(), x @ x, atol=1e-4)
remote = model.to("remote_accelerator:0")
print(float(remote(torch.ones(2, 256, device="remote_accelerator:0")).sum().item()))
genie.shutdown_sync()
"""


def _loads_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _children_loading_torch(node: NodeProcess) -> list[int]:
    return [c.pid for c in psutil.Process(node.pid).children(recursive=True) if _loads_torch(c.pid)]


def test_cpu_nodes_serve_sessions_weight_cache_hits_status_and_metrics_without_torch_in_their_own_process(
        genie_cluster: Callable[..., LocalCluster]) -> None:
    """Two sessions (the second's weights a cache hit), ``genie status``, the metrics endpoint: the master's and
    the worker's own processes never map libtorch, while their session workers do (so the probe can see it).
    They had imported it at start: 2.4 s of a core and about 240 MB each on a 2-core VM."""
    metrics_port = unused_port()  # --metrics-port 0 means off
    cluster = genie_cluster(workers=("w1",), master_args=("--metrics-port", str(metrics_port)))
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CLIENT, str(cluster.port)], capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout.strip())
    assert outputs[0] == outputs[1]
    status = subprocess.run([sys.executable, "-m", "genie.cli", "status", "--master", cluster.master_addr],
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr[-2000:]
    assert "w1" in status.stdout
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        scraped = reply.read().decode()
    saved = [float(line.split()[-1]) for line in scraped.splitlines() if line.startswith("genie_server_cache_saved")]
    assert saved and saved[0] >= 256 * 256 * 4, "the second session's weights were no cache hit:\n" + scraped[-2000:]
    for node in cluster.nodes():
        assert node.alive(), node.log()[-2000:]
        assert not _loads_torch(node.pid), f"{node.node_id}'s own process loaded torch:\n{node.log()[-2000:]}"
        assert _children_loading_torch(node), f"no session worker or zygote of {node.node_id} loaded torch"
