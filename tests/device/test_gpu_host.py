"""On a host with an NVIDIA GPU (skipped elsewhere: this machine has none): genie leaves CUDA fork-safe,
and a ``genie serve --devices cuda:0`` with process isolation (the default) runs work on the GPU.

Registering the device starts autograd's engine, which asks every device type for its count; CUDA answers
by initialising its driver, after which no ``fork()``ed child can use CUDA. ``genie serve``'s session
workers are forked from a zygote that imported torch (so registered the device): on a GPU host they
failed their first CUDA op with "CUDA error: initialization error" until registration stopped doing
that there. Run with the server on the GPU: ``GENIE_TEST_SERVER_DEVICES=cuda:0,cuda:0``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda._is_compiled() and shutil.which("nvidia-smi") and os.path.exists("/dev/nvidiactl")),
    reason="needs an NVIDIA GPU, its driver and a CUDA build of torch (none here)",
)


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_import_leaves_cuda_uninitialised_so_a_forked_child_can_use_the_gpu() -> None:
    done = _python("""
        import os, sys, torch, genie
        assert not torch.cuda.is_initialized()
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if torch.ones(4, device="cuda").sum().item() == 4 else 2)
            except BaseException as exc:
                print("child:", exc, flush=True)
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_gpu_server_with_process_isolation_runs_a_matmul_and_a_backward() -> None:
    done = _python("""
        import torch, genie
        from genie.cluster.launch import NodeProcess
        with NodeProcess("serve", "--port", "0", "--devices", "cuda:0", "--isolation", "process") as server:
            genie.init_sync(master_addr="127.0.0.1", master_port=server.control_port, timeout=60)
            try:
                x = torch.randn(256, 256, requires_grad=True)
                r = x.detach().to("remote_accelerator:0").requires_grad_()
                (r @ r).sum().backward()
                (x @ x).sum().backward()
                torch.testing.assert_close(r.grad.cpu(), x.grad, rtol=1e-4, atol=1e-3)
                assert torch.remote_accelerator.get_device_properties(0).name.startswith("NVIDIA"), \\
                    torch.remote_accelerator.get_device_properties(0)
            except BaseException:
                print(server.log()[-4000:])
                raise
            finally:
                genie.shutdown_sync()
    """)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_device_side_assert_ends_only_the_session_that_hit_it() -> None:
    """An out-of-range index is a device-side assert on CUDA: that session is answered the error, then ends
    (RemoteDeviceLost at its next call); the server serves the next session on the GPU."""
    from genie.cluster.launch import NodeProcess

    with NodeProcess("serve", "--port", "0", "--devices", "cuda:0", "--isolation", "process") as server:
        hit = _python(f"""
            import torch, genie
            from genie.errors import RemoteDeviceLost, RemoteExecutionError
            genie.init_sync(master_addr="127.0.0.1", master_port={server.control_port}, timeout=60)
            x = torch.randn(3, device="remote_accelerator:0")
            bad = x[torch.tensor([0, 9], device="remote_accelerator:0")]
            try:
                bad.cpu()
                raise SystemExit("an out-of-range index on CUDA raised nothing")
            except RemoteExecutionError as exc:
                assert "device-side assert" in str(exc), exc
            try:
                x.cpu()
                raise SystemExit("the session went on after a device-side assert")
            except RemoteDeviceLost as exc:
                print("lost:", exc, flush=True)
            genie.shutdown_sync()
        """)
        assert hit.returncode == 0 and "lost:" in hit.stdout, hit.stdout + hit.stderr
        after = _python(f"""
            import torch, genie
            genie.init_sync(master_addr="127.0.0.1", master_port={server.control_port}, timeout=60)
            assert torch.ones(4, device="remote_accelerator:0").sum().item() == 4
            genie.shutdown_sync()
        """)
        assert after.returncode == 0, after.stdout + after.stderr + server.log()[-3000:]


def test_genie_installed_leaves_local_cuda_training_working_until_its_device_is_used() -> None:
    """torch's autoload imports genie at ``import torch``; on a GPU host it must not register the device, or
    every CUDA backward of the process fails inside PyTorch (pytorch/pytorch#161129). Using genie's device
    registers it and warns that this process's CUDA backward is now off."""
    done = _python("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        assert torch._C._get_privateuse1_backend_name() == "privateuseone", "registered at torch import"
        x = torch.randn(64, 64, device="cuda", requires_grad=True)
        (x @ x).sum().backward()
        assert x.grad is not None and torch.accelerator.current_accelerator().type == "cuda"
        import genie.device
        assert torch._C._get_privateuse1_backend_name() == "remote_accelerator"
        print("ok", flush=True)
    """)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
    assert "161129" in done.stderr, done.stderr
