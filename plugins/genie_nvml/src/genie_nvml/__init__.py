"""genie-nvml: GPU metrics and GPU health checks for genie, through NVML.

Quick start
===========

Install it next to genie; the ``genie`` entry point ``nvml`` loads it::

    pip install genie-nvml          # brings nvidia-ml-py (the ``pynvml`` module)
    genie plugins                   # lists "nvml" with its hooks

Nothing else to configure. Every ``gpu_poll_interval`` (5 s) the resource
monitor calls ``genie_node_metrics`` in a worker thread; this plugin answers
``{"gpus": [...], "nvml": {...}}`` with, per GPU, name, uuid, memory total/used,
utilization, temperature, power, clocks, ECC error counts, retired pages or
remapped rows, and Xid errors, each where the GPU offers it (a figure NVML does
not support is left out). See :mod:`genie_nvml.reader` for every key and unit.

Where the data comes from, in order:

1. NVML through ``pynvml`` (``libnvidia-ml.so``, installed with the driver);
2. ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` when the NVML
   library is missing but the tool is on PATH;
3. otherwise nothing: ``"nvml": {"available": False, "status":
   "unavailable: NVML library not found"}``, and no GPUs. Never an exception.

Health checks (``genie_health_checks``), run by the health checker:

- ``gpu_temperature``: DEGRADED from 85 °C, UNHEALTHY from 90, CRITICAL from 95;
- ``gpu_memory``: DEGRADED from 95 % used, UNHEALTHY from 99 %;
- ``gpu_errors``: lost GPU, failed row remapping or a critical Xid (79, 95) is
  CRITICAL; uncorrected ECC errors are UNHEALTHY; pending page retirement and
  other recent Xids are DEGRADED.

For tests, build a reader around a fake module, ``NvmlReader(module=fake_pynvml)``,
or point the fallback at a script, ``NvmlReader(nvidia_smi="/path/to/fake")``.
"""

from __future__ import annotations

import logging
from typing import Any

from genie import hookimpl
from genie_nvml.checks import GpuErrorCheck, GpuMemoryCheck, GpuTemperatureCheck
from genie_nvml.reader import GpuReading, NvmlReader

__version__ = "0.1.0"
__all__ = ["GpuErrorCheck", "GpuMemoryCheck", "GpuReading", "GpuTemperatureCheck", "NvmlReader", "reader"]

log = logging.getLogger("genie.nvml")

#: The process's reader, shared by the metrics hook and the checks (NVML is initialised once).
reader = NvmlReader()


@hookimpl
def genie_node_metrics(node: Any) -> dict[str, Any]:
    """This host's GPUs: ``{"gpus": [...], "nvml": {"available", "source", "status", ...}}``."""
    try:
        return reader.read().fragment()
    except Exception as exc:  # a driver surprise must not cost the node its other metrics
        log.exception("reading GPUs failed")
        return GpuReading("none", reason=f"reading GPUs failed: {type(exc).__name__}: {exc}").fragment()


@hookimpl
def genie_health_checks() -> list[Any]:
    """GPU temperature, memory pressure and hardware-error checks."""
    return [GpuTemperatureCheck(reader), GpuMemoryCheck(reader), GpuErrorCheck(reader)]
