"""The zygote's warm-up (genie.server.isolation.warm): a worker's first op imports nothing more.

Real interpreter subprocesses: one imports the warm-up module as the zygote does (PRELOAD), then
runs a pre-flight of another op, as a session's first op does, and reports the modules that op
still imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

from genie.server.isolation.supervisor import PRELOAD

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
