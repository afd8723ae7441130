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
from typing import Any

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
    """Run in a worker forked from the zygote: what it has before it does anything, and whether the pre-flights of
    a model's usual ops import dynamo (torch's Python meta kernels would, genie.lazy_dynamo keeps them from it)."""
    import torch

    from genie.server import preflight
    from genie.server.isolation import worker

    found = {"dynamo": "torch._dynamo" in sys.modules, "sympy": "sympy" in sys.modules,
             "warmed": worker._warmed.is_set(), "omp": os.environ.get("OMP_WAIT_POLICY")}
    aten, e = torch.ops.aten, torch.empty
    cases: list[tuple[Any, list[Any]]] = [(aten.native_layer_norm.default, [e(2, 4), [4], e(4), e(4), 1e-5]), (aten.rsqrt.default, [e(3)]),
                     (aten.exp.default, [e(3)]), (aten._softmax.default, [e(3, 3), 1, False]),
                     (aten.gelu.default, [e(3)]), (aten.sum.default, [e(4)]), (aten.mm.default, [e(2, 3), e(3, 2)]),
                     (aten.convolution.default, [e(1, 3, 8, 8), e(4, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], False,
                                                 [0, 0], 1])]
    for op, args in cases:
        preflight.check(op, str(op), args, {}, max_elements=0, remaining_bytes=None)
    conn.send({**found, "dynamo_after_preflights": "torch._dynamo" in sys.modules})


def test_a_zygote_worker_has_the_preflights_imports_but_no_dynamo_and_the_caller_imported_no_torch() -> None:
    """The pre-flight's first-use imports are the zygote's, torch._dynamo not among them, nor imported by the
    pre-flights of a model's usual ops (1 to 3 s of a core per worker: genie.lazy_dynamo)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"caller_imported_torch": False, "dynamo": False, "sympy": True, "warmed": True,
                     "omp": "PASSIVE", "dynamo_after_preflights": False}
