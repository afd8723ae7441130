"""CUDA MPS for many small sessions on one GPU (opt-in: ``--cuda-mps``, ``GENIE_CUDA_MPS=1``).

Each session worker is its own process, so on a CUDA device each has its own CUDA context: a few
hundred MiB of GPU memory and a share of the GPU by time slices (bench_gpu measures both on the GPU
host: "per-session GPU memory" and "session start"). NVIDIA's Multi-Process Service runs the
contexts of many processes as one: kernels of different sessions run side by side and the
per-context memory shrinks. MPS is a daemon the host's operator runs (``nvidia-cuda-mps-control
-d``); genie does not start it, it only checks it is there before serving and points every session
worker at it.

Asked for where it cannot work, the node refuses to start with a :class:`~genie.errors.ConfigError`
that says why: no CUDA device is served, or no MPS control daemon listens in the pipe directory
(``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``). Without the option nothing here runs
(note that an MPS daemon running for the node's user serves every CUDA process of that user anyway).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence

from genie.errors import ConfigError
from genie.server.host import NodeDevice

#: The MPS pipe directory when CUDA_MPS_PIPE_DIRECTORY is not set (NVIDIA's default).
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # noqa: S108 - NVIDIA's fixed default, read only


def pipe_directory(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY


def _daemon_listens(directory: str) -> bool:
    """Whether the MPS control daemon's pipe (``control``, a FIFO) is in ``directory``."""
    try:
        return stat.S_ISFIFO(os.stat(os.path.join(directory, "control")).st_mode)
    except OSError:
        return False


def require(enabled: bool, devices: Sequence[NodeDevice], *, source: str = "argument cuda_mps",
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment session workers need for MPS (empty when not ``enabled``); ConfigError where MPS was
    asked for and cannot serve: no CUDA device among ``devices``, or no daemon in the pipe directory."""
    if not enabled:
        return {}
    if not any(d.type == "cuda" for d in devices):
        served = ",".join(str(d) for d in devices) or "none"
        raise ConfigError("cuda_mps", True, source, f"true only with CUDA devices to share; this node serves "
                                                    f"{served}: serve a GPU (--devices cuda:0) or drop --cuda-mps")
    directory = pipe_directory(environ)
    if not _daemon_listens(directory):
        raise ConfigError("cuda_mps", True, source,
                          f"true only where an MPS control daemon runs; none listens in {directory} (no 'control' pipe). "
                          "Start it as the GPU's user with `nvidia-cuda-mps-control -d` (set CUDA_MPS_PIPE_DIRECTORY "
                          "to its pipe directory if it is not the default), or drop --cuda-mps")
    return {"CUDA_MPS_PIPE_DIRECTORY": directory}


def enable(enabled: bool, devices: Sequence[NodeDevice], *, source: str = "argument cuda_mps") -> None:
    """Check MPS (:func:`require`) and set its environment for the session workers this node starts."""
    os.environ.update(require(enabled, devices, source=source))
