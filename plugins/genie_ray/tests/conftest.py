"""A real local Ray cluster of several raylets (``ray.cluster_utils.Cluster``) for the genie-ray tests.

The head node has no genie resource; two more raylets each offer one unit of the custom resource
``genie_slot`` (this machine has no GPU: a worker reserves that resource instead and serves a CPU
device; on GPU nodes the same code reserves ``GPU``). Ray must run inside a private network
namespace (``nox -s ray`` runs pytest under ``unshare -n``): its processes would otherwise talk
to addresses off this machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

#: The custom resource the test nodes offer in place of GPUs.
SLOT = "genie_slot"


@attrs.define
class RayTestCluster:
    """The running Ray cluster, its GCS address, the stand-in resource and the nodes that offer it."""

    cluster: Any  #: ray.cluster_utils.Cluster: add_node, remove_node
    address: str
    slot: str
    slot_nodes: list[Any]


def isolated() -> bool:
    """True inside a network namespace whose only interface is loopback."""
    # Asked of the kernel in this process's namespace (/sys/class/net shows the namespace sysfs was mounted in).
    return [name for _, name in socket.if_nameindex()] == ["lo"]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayTestCluster]:
    """Head + two raylets with one ``genie_slot`` each; this process connected as a driver."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'ray[default]==2.60.0' (nox -s ray does)")
    if not isolated():
        pytest.skip("Ray runs only inside a private network namespace here: run `nox -s ray`, or pytest under "
                    "`unshare -n sh -c 'ip link set lo up; ...'` as root")
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage reports, no attempt to reach the index
    # Short: Ray's unix socket paths live under it (108 bytes at most).
    temp = tempfile.mkdtemp(prefix="gray", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": temp,
        # Ray's own node failure detection, short for the test (defaults: 3 s x 5).
        "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 0},
    })
    try:
        slot_nodes = [cluster.add_node(num_cpus=0, resources={SLOT: 1}) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield RayTestCluster(cluster, cluster.address, SLOT, slot_nodes)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)

