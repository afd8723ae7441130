"""A worker behind a NAT: it binds one address and port, announces another, and clients reach it there.

The LinkEmulator stands in for the NAT's port mapping (and adds a small delay, as a real path would):
it listens on 127.0.0.2 and forwards to the worker's bound 127.0.0.1 data port. The worker is told
``--advertise-host 127.0.0.2 --advertise-ports <the mapping's port>``; a client that learns the
cluster from the master must reach the worker's device through the mapping, and every byte of its
session crosses it.
"""

from __future__ import annotations

import pytest

from genie.testing import LinkEmulator, LocalCluster, run_client

TCP = {"GENIE_BACKEND": "tcp"}  # one data port, the one the mapping forwards


@pytest.mark.slow
def test_a_worker_behind_a_port_mapping_is_reached_at_the_address_it_advertises() -> None:
    with LinkEmulator(("127.0.0.1", 1), host="127.0.0.2", delay=0.001) as nat:
        with LocalCluster(workers=(), env=TCP) as cluster:
            worker = cluster.add_worker("behind-nat", "--advertise-host", "127.0.0.2",
                                        "--advertise-ports", str(nat.port))
            assert f"advertised=127.0.0.2:{nat.port}" in worker.log()
            nat.target = ("127.0.0.1", worker.data_port)  # the mapping, now that the bound port is known
            done = run_client(cluster.port, """
                devices = {d["node_id"]: d["index"] for d in state.devices}
                dev = f"remote_accelerator:{devices['behind-nat']}"
                a = torch.arange(12.0).reshape(3, 4)
                y = (a.to(dev) @ a.T.to(dev)).cpu()
                assert torch.equal(y, a @ a.T), y
                print("OK", dev)
            """, env=TCP)
            assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
        stats = nat.stats()
        assert stats.connections >= 1 and stats.bytes_up > 0 and stats.bytes_down > 0, stats


def test_advertise_ports_is_validated_and_maps_backends() -> None:
    from genie.config import ClusterConfig
    from genie.errors import ConfigError

    cfg = ClusterConfig.from_sources({}, advertise_host="nat.example", advertise_ports="tcp=7000,shm=7001")
    assert cfg.announced_endpoint(41000, {"tcp": 41000, "shm": 41001}, primary="tcp") == \
        ("nat.example", 7000, {"tcp": 7000, "shm": 7001})
    bare = ClusterConfig.from_sources({"GENIE_ADVERTISE_PORTS": "7000"})
    assert bare.announced_endpoint(41000, {"tcp": 41000, "shm": 41001}, primary="tcp") == \
        ("127.0.0.1", 7000, {"tcp": 7000, "shm": 41001})
    for bad in ("tcp=0", "7000,7001", "tcp=7000,tcp=7001", "TCP=1", "tcp=x"):
        with pytest.raises(ConfigError, match="advertise_ports"):
            ClusterConfig.from_sources({}, advertise_ports=bad)
