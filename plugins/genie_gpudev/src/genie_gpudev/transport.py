"""The ``dpdk_gpudev`` transport: DPDK + gpudev + CUDA, probed piece by piece."""

from __future__ import annotations

import os
import sys
from typing import Any

import importlib_metadata
from genie_dpdk import eal
from genie_dpdk.transport import INSTALL_HINT

from genie.transport.base import ProbeOnlyTransport, ProbeTarget
from genie.transport.cache import find_library_file, path_fingerprint
from genie.types import Figure, ProbeResult

NO_DATA_PATH = (
    "the GPUDirect (dpdk_gpudev) data path is not implemented in genie-gpudev 0.1.0: it needs payload buffers in "
    "GPU memory (rte_gpu_mem_register, external mbufs), which only a DPDK built with its gpu_cuda driver, a CUDA "
    "GPU and a GPUDirect-capable NIC provide (hardware only); genie-dpdk carries host memory over DPDK today and "
    "rdma (NIXL) reaches GPU memory; use backend=auto or name another backend"
)
NVIDIA_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")

#: This backend's rank among backends (higher wins; tcp 100, dpdk 200, rdma 300, dpdk_gpudev 400, shm 500):
#: DPDK with payloads landing in GPU memory: above rdma, below shm.
PRIORITY_DPDK_GPUDEV = 400


def cuda_state() -> tuple[bool, str]:
    """Whether torch can use CUDA here, and why not; imports torch only when it might say yes."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False, "CUDA_VISIBLE_DEVICES is empty (no GPU visible)"
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            version = importlib_metadata.version("torch")
        except importlib_metadata.PackageNotFoundError:
            return False, "torch is not installed"
        if version.endswith("+cpu"):
            return False, f"torch {version} is a CPU-only build"
        driver = find_library_file("libcuda.so.1", "libcuda.so")
        if driver is None and not any(os.path.exists(p) for p in NVIDIA_FILES):
            return False, "no NVIDIA driver (libcuda.so.1 and /proc/driver/nvidia absent)"
        import torch as imported  # only here: a driver exists and torch may have CUDA

        torch = imported
    if not torch.cuda.is_available():
        return False, f"torch.cuda.is_available() is False (torch {torch.__version__})"
    return True, f"{torch.cuda.device_count()} CUDA device(s)"


def declared_figures() -> dict[str, Figure]:
    """Typical figures of GPUDirect over a 100 GbE NIC, as declared by this plugin (not measured)."""
    return {
        "bandwidth": Figure(100.0, "Gbit/s", measured=False),
        "latency": Figure(5.0, "us", measured=False),
        "zero_copy": Figure(1.0, "bool", measured=False),
    }


def probe_blocking(timeout: float, name: str = "dpdk_gpudev", priority: int = PRIORITY_DPDK_GPUDEV) -> ProbeResult:
    """Check every piece in order; the reason code is the first missing one, the text names all."""
    libs = eal.find_libraries()
    details: dict[str, Any] = {"libs": libs, "data_path": False, "data_path_note": NO_DATA_PATH}
    missing: list[tuple[str, str]] = []
    if not libs["eal"] or not libs["ethdev"]:
        missing.append(("library_missing", f"DPDK library not found: {INSTALL_HINT}"))
    elif not libs["gpudev"]:
        missing.append(("library_missing", f"librte_gpudev.so.{eal.ABI} not found: install librte-gpudev{eal.ABI} "
                                           "(Debian; part of the dpdk package)"))
    cuda_ok, cuda_why = cuda_state()
    details["cuda"] = cuda_why
    if not missing:
        report = eal.eal_report(timeout)
        details["stage"] = report.stage
        details["gpudev_devices"] = report.gpus
        if report.stage == "timeout":
            return ProbeResult(name, False, "timeout", report.error, priority=priority, details=details)
        if not report.ok:
            missing.append(("eal_init_failed", f"DPDK EAL did not start ({report.stage}): {report.error}"))
        elif not report.gpus:
            missing.append(("no_devices", "no GPU visible to DPDK gpudev (rte_gpu_count_avail() = 0; DPDK needs "
                                          "its gpu_cuda driver, which Debian's build lacks, and a CUDA GPU)"))
    if not cuda_ok:
        missing.append(("no_cuda", f"CUDA is not available: {cuda_why}"))
    if missing:
        return ProbeResult(name, False, missing[0][0], "; ".join(text for _, text in missing),
                           priority=priority, details=details)
    return ProbeResult(name, True, "ok", f"{details['gpudev_devices']} gpudev GPU(s); {cuda_why}",
                       priority=priority, figures=declared_figures(), details=details)


class GpudevTransport(ProbeOnlyTransport):
    """DPDK with GPUDirect RDMA through DPDK's gpudev library."""

    name = "dpdk_gpudev"
    no_data_path = NO_DATA_PATH
    default_priority = PRIORITY_DPDK_GPUDEV

    @classmethod
    def host_fingerprint(cls) -> dict[str, Any]:
        """The DPDK fingerprint plus the NVIDIA driver files and the CUDA device selection."""
        return {
            "dpdk": eal.host_fingerprint(),
            "nvidia": path_fingerprint([*NVIDIA_FILES, find_library_file("libcuda.so.1") or "libcuda.so.1"]),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """DPDK, librte_gpudev, a gpudev GPU, CUDA: see :func:`probe_blocking`."""
        return await self.run_blocking_probe(probe_blocking, target, self.name, self.default_priority)

