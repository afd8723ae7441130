"""Using the device before genie.init() (its own module: no fixture has initialised genie here)."""

from __future__ import annotations

import pytest
import torch

import genie
from genie.errors import NotInitializedError

D0 = "remote_accelerator:0"


def test_using_the_device_before_init_is_a_clear_error() -> None:
    if genie.is_initialized():
        pytest.skip("genie is initialised by another test in this session")
    from genie.device import ensure_registered

    ensure_registered()
    with pytest.raises(NotInitializedError, match="genie.init"):
        torch.zeros(1, device=D0)


def test_torch_profiler_runs_in_a_process_where_genie_is_registered_but_not_initialised(tmp_path) -> None:
    """torch.profiler syncs the renamed PrivateUse1 backend at its exit (torch.remote_accelerator.synchronize());
    before genie.init() nothing was sent, so that is nothing to wait for. It raised NotInitializedError, so any
    process that imported genie (or had the device autoloaded) could not profile CPU code. A fresh process."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "profile_before_init.py"
    script.write_text(textwrap.dedent("""
        import torch, genie
        from genie.device import ensure_registered
        ensure_registered()
        with torch.profiler.profile() as p:
            (torch.ones(8) + 1).sum()
        print("profiled", any(e.name == "aten::add" for e in p.events()), flush=True)
        try:
            torch.remote_accelerator.synchronize(0)  # a device named explicitly is still an error
        except genie.errors.NotInitializedError:
            print("explicit device refused", flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert "profiled True" in out.stdout and "explicit device refused" in out.stdout, out.stdout + out.stderr


def test_cpu_backward_before_init_leaves_remote_backward_working_on_every_device(tmp_path) -> None:
    """Autograd's engine sizes its per-device queues at its first backward; one on the CPU before
    genie.init() must still leave a queue for remote_accelerator:1 (a separate process: fresh engine)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "cpu_backward_first.py"
    script.write_text(textwrap.dedent("""
        import socket, torch, genie
        from genie.cluster.launch import NodeProcess
        w = torch.ones(3, requires_grad=True)
        (w * 2).sum().backward()                       # the engine starts here, before init
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        with NodeProcess("serve", "--port", str(port), "--devices", "cpu,cpu"):
            genie.init_sync(master_addr="127.0.0.1", master_port=port)
            for d in ("remote_accelerator:0", "remote_accelerator:1"):
                r = torch.ones(3, device=d, requires_grad=True)
                (r * 3).sum().backward()
                print(d, r.grad.tolist(), flush=True)
            genie.shutdown_sync()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert "remote_accelerator:1 [3.0, 3.0, 3.0]" in out.stdout, out.stdout + out.stderr
    assert "remote_accelerator:0 [3.0, 3.0, 3.0]" in out.stdout


def test_on_a_simulated_gpu_host_autograd_is_primed_by_init_not_at_import(tmp_path) -> None:
    """On a host with a CUDA driver, registration must not start autograd's engine (that initialises the
    CUDA driver, and a forked child, genie serve's session workers included, can then not use CUDA):
    genie.init() does it. This machine has no GPU: the driver's presence is SIMULATED (a CUDA build and
    /dev/nvidiactl reported while the device registers); the real case ran on an H200
    (tests/device/test_gpu_host.py)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "gpu_host_priming.py"
    script.write_text(textwrap.dedent("""
        import os, socket, torch
        real_exists, real_compiled = os.path.exists, torch.cuda._is_compiled
        os.path.exists = lambda p: p == "/dev/nvidiactl" or real_exists(p)
        torch.cuda._is_compiled = lambda: True
        from genie.device import registration
        registration.ensure_registered()
        os.path.exists, torch.cuda._is_compiled = real_exists, real_compiled
        print("primed at import:", registration._primed, flush=True)
        import genie
        from genie.cluster.launch import NodeProcess
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        with NodeProcess("serve", "--port", str(port), "--devices", "cpu,cpu"):
            genie.init_sync(master_addr="127.0.0.1", master_port=port)
            print("primed after init:", registration._primed, flush=True)
            r = torch.ones(3, device="remote_accelerator:1", requires_grad=True)
            (r * 3).sum().backward()
            print("remote_accelerator:1", r.grad.tolist(), flush=True)
            genie.shutdown_sync()
    """))
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # registration only when the script asks
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
    text = out.stdout + out.stderr
    assert "primed at import: False" in out.stdout, text
    assert "primed after init: True" in out.stdout, text
    assert "remote_accelerator:1 [3.0, 3.0, 3.0]" in out.stdout, text


def test_on_a_simulated_gpu_host_torch_import_leaves_cuda_as_the_accelerator(tmp_path) -> None:
    """A registered PrivateUse1 backend becomes torch's accelerator and breaks every CUDA backward of the
    process (pytorch/pytorch#161129), so on a GPU host torch's autoload must not register the device: genie's
    first use does, and says what it costs. SIMULATED: a CUDA build and /dev/nvidiactl are reported while
    autoload and registration run (no GPU here); tests/device/test_gpu_host.py runs a real CUDA backward."""
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "gpu_host_autoload.py"
    script.write_text(textwrap.dedent("""
        import logging, os, torch
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        real_exists, real_compiled = os.path.exists, torch.cuda._is_compiled
        os.path.exists = lambda p: p == "/dev/nvidiactl" or real_exists(p)
        torch.cuda._is_compiled = lambda: True
        from genie.device import registration  # registers (genie.device's import): that is genie's first use
        print("after genie.device:", torch._C._get_privateuse1_backend_name(), flush=True)
    """))
    autoload = textwrap.dedent("""
        import os, torch
        os.path.exists = (lambda real: lambda p: p == "/dev/nvidiactl" or real(p))(os.path.exists)
        torch.cuda._is_compiled = lambda: True
        import genie.autoload
        genie.autoload.autoload()                      # what `import torch` runs through its entry point
        print("after autoload:", torch._C._get_privateuse1_backend_name(), flush=True)
    """)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # the script runs autoload itself, simulated
    first = subprocess.run([sys.executable, "-c", autoload], capture_output=True, text=True, timeout=90, env=env)
    assert "after autoload: privateuseone" in first.stdout, first.stdout + first.stderr
    used = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
    assert "after genie.device: remote_accelerator" in used.stdout, used.stdout + used.stderr
    assert "161129" in used.stderr and "local CUDA" in used.stderr, used.stderr
