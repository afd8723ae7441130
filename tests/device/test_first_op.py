"""The first op after init does not import torch._dynamo; torch's dynamo.disable wrappers still work (issue 16).

Fresh interpreters (the imports under test happen once per process), against the real server
process of the ``cpu_server`` fixture.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from genie.cluster.launch import NodeProcess
from genie.testing import run_client


def test_first_op_after_init_imports_no_dynamo(cpu_server: NodeProcess) -> None:
    done = run_client(cpu_server.control_port, """
        import sys
        x = torch.ones(4, device="remote_accelerator:0")
        assert (x + 1).sum().item() == 8.0
        assert (x * 2.5).mean().item() == 2.5
        y = torch.nn.functional.layer_norm(x.view(2, 2).exp().rsqrt(), [2]).softmax(-1)
        assert y.shape == (2, 2) and abs(y.sum().item() - 2.0) < 1e-5
        assert "torch._dynamo" not in sys.modules, "the first ops imported torch._dynamo"
        print("OK")
    """)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_stand_ins_give_way_to_torch_disable_once_dynamo_is_imported() -> None:
    """The stand-in runs the kernel directly while dynamo is absent and installs torch's real disable after."""
    script = textwrap.dedent("""
        import sys
        import torch
        import torch._refs
        from genie import lazy_dynamo
        assert "torch._dynamo" not in sys.modules
        assert lazy_dynamo.defer() > 200  # the elementwise references' wrappers among them
        assert lazy_dynamo.defer() == 0  # once
        fn = torch._refs.add.__wrapped__.__closure__[0].cell_contents  # out_wrapper -> disable wrapper -> fn
        stand_in = getattr(fn, "__dynamo_disable")
        a = torch.ones(3, device="meta")
        out = torch.ops.aten.add.out(a, a, out=torch.empty(3, device="meta"))
        assert out.shape == (3,) and "torch._dynamo" not in sys.modules
        import torch._dynamo
        torch.ops.aten.add.out(a, a, out=torch.empty(3, device="meta"))
        real = getattr(fn, "__dynamo_disable")
        assert real is not stand_in and getattr(real, "_torchdynamo_disable", False), real
        print("OK")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
