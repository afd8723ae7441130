"""The session workers' zygote: started before the node imports torch, and paying the pre-flight's imports once.

Each case runs in a fresh interpreter (a subprocess): multiprocessing keeps one forkserver per process, and pytest's
own imported torch long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, sys
from genie.server.isolation import zygote
zygote.start()
before = "torch" in sys.modules  # start() itself imports no torch: the node imports it beside the zygote
from multiprocessing import get_context
from tests.server.test_zygote import report
ours, theirs = get_context("forkserver").Pipe()
child = zygote.WorkerProcess(target=report, args=(theirs,), daemon=True)
child.start()
if not ours.poll(120):
    raise SystemExit("the forked worker did not report within 120 s")
print(json.dumps({"caller_imported_torch": before, **ours.recv()}))
child.join(10)
"""


def report(conn) -> None:  # type: ignore[no-untyped-def]
    """Run in a worker forked from the zygote: what it has before it does anything."""
    from genie.server.isolation import worker

    conn.send({"dynamo": "torch._dynamo" in sys.modules, "sympy": "sympy" in sys.modules,
               "warmed": worker._warmed.is_set(), "omp": os.environ.get("OMP_WAIT_POLICY")})


def test_a_worker_forked_from_the_zygote_has_the_preflights_imports_and_the_caller_imported_no_torch() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"caller_imported_torch": False, "dynamo": True, "sympy": True, "warmed": True,
                     "omp": "PASSIVE"}
