"""Errors on the remote device: where they surface and what they say."""

from __future__ import annotations

import pytest
import torch

from genie.errors import RemoteDeviceLost, RemoteExecutionError

D0 = "remote_accelerator:0"


def test_shape_errors_surface_at_the_line_that_caused_them(remote) -> None:
    a = torch.ones(3, 4, device=D0)
    b = torch.ones(5, 6, device=D0)
    with pytest.raises(RuntimeError, match="cannot be multiplied|same reduction dim"):
        a @ b


@pytest.mark.cpu_server  # on CUDA the bad index is a device-side assert, which ends the session's CUDA context
def test_server_side_failure_surfaces_at_the_next_sync_point_naming_the_op(remote) -> None:
    idx = torch.tensor([0, 7], device=D0)  # out of range for a 3-row table: only the server can know
    table = torch.randn(3, 2, device=D0)
    picked = table[idx]  # fire-and-forget: no error yet
    with pytest.raises(RemoteExecutionError, match=r"aten::index.*shapes"):
        picked.cpu()
    assert torch.ones(2, device=D0).sum().item() == 2.0  # the session keeps working


def test_unknown_device_index_is_a_clear_error(remote) -> None:
    with pytest.raises(Exception, match="does not exist"):
        torch.zeros(1, device="remote_accelerator:7")


def test_killed_server_gives_remote_device_lost_not_a_hang(tmp_path) -> None:
    """A separate process: init against a private server, kill -9 it, expect RemoteDeviceLost quickly."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch, genie
        from genie.cluster.launch import NodeProcess
        from genie.errors import RemoteDeviceLost
        import socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        server = NodeProcess("serve", "--port", str(port), "--devices", "cpu").start()
        try:
            genie.init_sync(master_addr="127.0.0.1", master_port=port, heartbeat_interval=0.2,
                            heartbeat_timeout=1, op_timeout=5)
            x = torch.ones(3, device="remote_accelerator:0")
            assert x.sum().item() == 3.0
            server.kill()
            t0 = time.monotonic()
            try:
                (x * 2).cpu()
            except RemoteDeviceLost as exc:
                print("LOST", round(time.monotonic() - t0, 2), exc)
            else:
                print("NO ERROR")
            try:
                torch.ones(1, device="remote_accelerator:0").cpu()
            except RemoteDeviceLost:
                print("STILL LOST")
        finally:
            server.stop()
            genie.shutdown_sync()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "LOST" in out.stdout, out.stdout + out.stderr
    assert "STILL LOST" in out.stdout
    seconds = float(out.stdout.split("LOST", 1)[1].split()[0])
    assert seconds < 6
    assert "remote_accelerator:0" in out.stdout or "node" in out.stdout
    _ = RemoteDeviceLost


def test_an_idle_client_keeps_its_session_and_its_tensors(tmp_path) -> None:
    """The server closes sessions idle for session_idle_timeout; the client's runtime sends keepalives."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "idle.py"
    script.write_text(textwrap.dedent("""
        import os, socket, time, torch, genie
        from genie.cluster.launch import NodeProcess
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        env = {"GENIE_SESSION_IDLE_TIMEOUT": "2"}  # keepalives every 0.67 s: a 1.3 s stall of a busy host is no loss
        with NodeProcess("serve", "--port", str(port), "--devices", "cpu", env=env):
            genie.init_sync(master_addr="127.0.0.1", master_port=port)
            x = torch.full((3,), 2.0, device="remote_accelerator:0")
            x.sum().item()
            time.sleep(5)                         # not a wait: idle for two and a half timeouts is the test
            print("SUM", x.sum().item(), flush=True)
            genie.shutdown_sync()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "SUM 6.0" in out.stdout, out.stdout + out.stderr


def test_a_node_lost_during_backward_surfaces_at_the_next_sync_point_without_aborting(tmp_path) -> None:
    """An exception inside backward on this device would abort the process (torch's Python device guard
    has a noexcept path); a lost node's work is dropped there and reported at the next sync point."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "lost_in_backward.py"
    script.write_text(textwrap.dedent("""
        import socket, torch, genie
        from genie.cluster.launch import NodeProcess
        from genie.device.registry import table
        from genie.errors import RemoteDeviceLost
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        with NodeProcess("serve", "--port", str(port), "--devices", "cpu"):
            genie.init_sync(master_addr="127.0.0.1", master_port=port)
            w = torch.ones(3, device="remote_accelerator:0", requires_grad=True)
            loss = (w * 2).sum()
            seed = torch.ones_like(loss)          # made before the loss, so only the engine's work remains
            table().get(0).connection.mark_lost("killed for the test")
            loss.backward(seed)
            print("BACKWARD RETURNED", flush=True)
            try:
                w.grad.cpu()
            except RemoteDeviceLost:
                print("LOST AT SYNC", flush=True)
            genie.shutdown_sync()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "BACKWARD RETURNED" in out.stdout and "LOST AT SYNC" in out.stdout, out.stdout + out.stderr
