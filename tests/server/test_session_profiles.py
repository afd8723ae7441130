"""``genie serve --profile-sessions DIR``: each session worker's torch.profiler profile (genie.server.profiles).

A real node and a real client process; the profile files are what the session worker wrote when its session
ended. On this CPU node there is no device activity, so the device's busy time is 0 (a CUDA node's kernels are
what ``scripts/gpu-check``'s ``profile`` step reads).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from genie.errors import ConfigError, GenieError
from genie.server.profiles import check_directory
from genie.testing import NodeProcess, wait_until

_CLIENT = r"""
import sys, torch, genie
genie.init_sync(master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=30)
x = torch.randn(64, 64, device="remote_accelerator:0")
for _ in range(7):
    x = torch.tanh(x @ x)
print(float(x.sum().item()))
genie.shutdown_sync()
"""


def test_each_session_writes_its_ops_profile_when_it_ends(tmp_path: Path) -> None:
    """Two sessions, two profiles: the ops each ran (7 matmuls), their CPU time, the wall of the session; the
    text table beside them."""
    profiles = tmp_path / "profiles"  # made by the node
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--profile-sessions", str(profiles)) as node:
        for _ in range(2):
            done = subprocess.run([sys.executable, "-c", _CLIENT, str(node.control_port)], capture_output=True,
                                  text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stderr[-3000:] + node.log()[-2000:]
        written = wait_until(lambda: found if len(found := sorted(profiles.glob("session-*.json"))) == 2 else None,
                             60, what="two sessions' profiles")
    assert not list(profiles.glob("*.partial")), "a profile is written whole, then renamed"
    for path in written:
        data = json.loads(path.read_text())
        assert data["devices"] == ["cpu"] and data["pid"] > 0
        assert data["wall_s"] > 0 and data["cpu_op_s"] > 0
        assert data["device_s"] == 0 and data["kernels"] == 0, "a CPU node has no device activity"
        rows = {r["name"]: r for r in data["rows"]}
        # 7 run, and the node's pre-flight of each new signature on meta tensors (genie.server.preflight) is an op too
        assert rows["aten::mm"]["count"] in (7, 8) and rows["aten::mm"]["self_cpu_us"] > 0
        assert rows["aten::tanh"]["count"] in (7, 8)
        assert "aten::mm" in path.with_suffix(".txt").read_text()
    assert {json.loads(p.read_text())["session_id"] for p in written} == {1, 2}


def test_a_profile_directory_under_home_is_where_the_node_made_it(tmp_path: Path) -> None:
    """``~/profiles``: the node creates it under $HOME, and its session workers write there (not into a ``~``
    directory of their working directory)."""
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--profile-sessions", "~/profiles",
                     env={"HOME": str(tmp_path)}) as node:
        done = subprocess.run([sys.executable, "-c", _CLIENT, str(node.control_port)], capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-3000:] + node.log()[-2000:]
        written = wait_until(lambda: sorted((tmp_path / "profiles").glob("session-*.json")), 60,
                             what="the session's profile under $HOME")
    assert [p.name for p in written] == ["session-1.json"]


def test_a_node_refuses_to_profile_sessions_in_its_own_threads(tmp_path: Path) -> None:
    """One profiler runs per process: with ``--isolation none`` the node does not start, and says why."""
    node = NodeProcess("serve", "--port", "0", "--devices", "cpu", "--isolation", "none", "--profile-sessions",
                       str(tmp_path), ready_timeout=60)
    with pytest.raises(GenieError, match=r"(?s)profile_sessions.*isolation = process"):
        node.start()


def test_a_profile_directory_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="profile_sessions.*a directory this node can create"):
        check_directory(str(blocker / "profiles"), "process", "argument profile_sessions")
    assert check_directory("", "none", "argument profile_sessions") is None, "off needs nothing"
    assert check_directory(str(tmp_path / "a" / "b"), "process", "x") == tmp_path / "a" / "b"
