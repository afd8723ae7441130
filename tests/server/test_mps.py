"""CUDA MPS is opt-in and refused where it cannot serve (genie.server.mps): the error paths, on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from genie.errors import ConfigError
from genie.server import mps
from genie.server.host import NodeDevice

CUDA0 = NodeDevice("cuda", 0)


def test_off_by_default_needs_nothing() -> None:
    assert mps.require(False, [NodeDevice("cpu")]) == {}


def test_refused_without_a_cuda_device() -> None:
    with pytest.raises(ConfigError, match="only with CUDA devices to share; this node serves cpu"):
        mps.require(True, [NodeDevice("cpu")])


def test_refused_without_a_daemon_names_the_pipe_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nvidia-cuda-mps-control -d") as info:
        mps.require(True, [CUDA0], environ={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert f"none listens in {tmp_path}" in str(info.value)


def test_a_listening_daemon_gives_the_workers_its_pipe_directory(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "control")  # what nvidia-cuda-mps-control -d makes
    assert mps.require(True, [CUDA0], environ={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == {
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}


def test_genie_serve_with_cuda_mps_on_cpu_exits_with_the_reason() -> None:
    run = subprocess.run([sys.executable, "-m", "genie.cli", "serve", "--port", "0", "--devices", "cpu", "--cuda-mps"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "cuda_mps" in run.stderr and "only with CUDA devices" in run.stderr
