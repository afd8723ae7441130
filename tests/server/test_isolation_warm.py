"""How session workers start: the zygote's warm-up (genie.server.isolation.warm), so a worker's first
op imports nothing more, and its OpenMP environment (passive waits, unless the operator chose).

Real interpreter subprocesses: one imports the warm-up module as the zygote does (PRELOAD), then
runs a pre-flight of another op, as a session's first op does, and reports the modules that op
still imported. The environment is read from a real worker's /proc entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from genie.server.isolation.supervisor import PRELOAD, worker_environment
from tests.conftest import wait_until
from tests.raw_client import RawClient

_FIRST_OP = """
import json, sys
{warm}
import torch
from genie.server import preflight
from genie.server.ops import resolve_op
before = set(sys.modules)
op = resolve_op("aten::mul.Tensor")
preflight.check(op, "aten::mul.Tensor", [torch.ones(3), torch.ones(3)], {{}},
                max_elements=preflight.DEFAULT_MAX_OP_ELEMENTS, remaining_bytes=1 << 20)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _first_op_imports(warm: bool) -> list[str]:
    code = _FIRST_OP.format(warm="import genie.server.isolation.warm" if warm else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_zygote_preloads_the_warm_up() -> None:
    assert "genie.server.isolation.warm" in PRELOAD


def test_after_the_warm_up_a_first_op_imports_no_module() -> None:
    assert _first_op_imports(warm=False), "without the warm-up the first pre-flight imports torch's meta tables"
    assert _first_op_imports(warm=True) == []


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
