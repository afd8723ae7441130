"""genie-gpudev: the ``dpdk_gpudev`` transport (priority 400): DPDK with GPUDirect (gpudev).

Quick start for plugin authors: a transport plugin may build on another one.
This package depends on genie-dpdk and reuses its EAL probe helper rather than
starting a second EAL::

    from genie_dpdk import eal
    report = eal.eal_report(timeout)      # one EAL start, shared with the dpdk probe
    report.gpus                           # rte_gpu_count_avail(), or None without librte_gpudev

Entry point (``pyproject.toml``)::

    [project.entry-points.genie]
    gpudev = "genie_gpudev"

What the probe checks, each with its own reason: the DPDK libraries
(``library_missing``), ``librte_gpudev.so.23`` (``library_missing``), the EAL
(``eal_init_failed``), a GPU that DPDK's gpudev sees (``no_devices``: Debian's
DPDK is built without the ``gpu_cuda`` driver, so this is the usual answer), and
CUDA in torch (``no_cuda``). The reason lists every missing piece, not just the
first. Without a GPU it never imports torch unless torch is already loaded: a
CPU-only torch build or a missing NVIDIA driver is recognised from files.

Honest limits: the GPUDirect data path is not implemented in this release;
``connect()``/``listen()`` raise ``BackendUnavailableError`` and the probe result
carries ``details["data_path"] = False``. The route it would take is hardware only:
genie-dpdk's reliable stream with payload buffers in GPU memory, registered with
``rte_gpu_mem_register`` and attached to mbufs as external buffers, which needs
DPDK's ``gpu_cuda`` driver, a CUDA GPU and a GPUDirect-capable NIC
(docs/backends.md). GPU memory is reachable today through rdma (NIXL).
"""

from __future__ import annotations

from genie.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def genie_transports() -> list[type]:
    """The ``dpdk_gpudev`` transport."""
    from genie_gpudev.transport import GpudevTransport

    return [GpudevTransport]
