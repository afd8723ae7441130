"""How session workers start: their OpenMP environment (passive waits, unless the operator chose).

The environment is read from a real worker's /proc entry (an in-process node, a raw wire client).
"""

from __future__ import annotations

import os

import pytest

from genie.server.isolation.zygote import worker_environment
from tests.conftest import wait_until
from tests.raw_client import RawClient


def test_worker_environment_sets_passive_openmp_waits_but_keeps_the_operators_choice() -> None:
    env: dict[str, str] = {}
    worker_environment(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    worker_environment(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_a_session_worker_starts_with_passive_openmp_waits(inproc_server) -> None:
    if os.environ.get("OMP_WAIT_POLICY", "PASSIVE").upper() != "PASSIVE":
        pytest.skip("this environment sets OMP_WAIT_POLICY itself (workers keep the operator's choice)")
    # Generous start-up bounds: the zygote imports torch and warms up first (seconds on a loaded machine).
    server = inproc_server(devices=1, hello_timeout=120, handshake_timeout=120)
    with RawClient(server.port, timeout=120) as client:
        client.handshake()
        per = wait_until(lambda: (p := server.stats()["per_session"]) and len(p) == 1 and p, timeout=30)
        pid = next(iter(per.values()))["pid"]
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    assert b"OMP_WAIT_POLICY=PASSIVE" in environ
