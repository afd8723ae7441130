"""GPU health checks: temperature, memory pressure, and hardware errors (ECC, retired pages, Xid).

Each check reads through a shared :class:`~genie_nvml.reader.NvmlReader` (a reading
younger than ``max_age`` seconds is reused, so the checks and the monitor do not
each wake the driver). Without GPU data (no NVML, no nvidia-smi) every check is
HEALTHY and says why there is nothing to check: a host without GPUs is not ill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from genie.cluster.checks import Thresholds
from genie.types import HealthResult, NodeStatus, worst_health
from genie_nvml.reader import GpuReading, NvmlReader

#: Xid codes worse than the default DEGRADED (see NVIDIA's Xid catalog).
XID_GRADES: dict[int, NodeStatus] = {
    48: NodeStatus.UNHEALTHY,  # double-bit ECC error
    74: NodeStatus.UNHEALTHY,  # NVLink error
    79: NodeStatus.CRITICAL,  # GPU has fallen off the bus
    92: NodeStatus.DEGRADED,  # high single-bit ECC error rate
    94: NodeStatus.DEGRADED,  # contained ECC error
    95: NodeStatus.CRITICAL,  # uncontained ECC error
    119: NodeStatus.UNHEALTHY,  # GSP RPC timeout
    120: NodeStatus.UNHEALTHY,  # GSP error
}


def _label(gpu: dict[str, Any]) -> str:
    return f"GPU {gpu.get('index')} ({gpu.get('name') or 'unknown'})"


class _GpuCheck:
    name = "gpu"

    def __init__(self, reader: NvmlReader, *, max_age: float = 2.0) -> None:
        self.reader = reader
        self.max_age = max_age

    def check(self) -> HealthResult:
        reading = self.reader.read(max_age=self.max_age)
        if not reading.available:
            return HealthResult(self.name, NodeStatus.HEALTHY, f"no GPU data: {reading.reason}",
                                {"available": False})
        if not reading.gpus:
            return HealthResult(self.name, NodeStatus.HEALTHY, "no GPUs", {"available": True})
        return self.grade(reading)

    def grade(self, reading: GpuReading) -> HealthResult:
        raise NotImplementedError

    def _per_gpu(
        self, reading: GpuReading, judge: Callable[[dict[str, Any]], tuple[NodeStatus, str] | None], ok: str
    ) -> HealthResult:
        verdicts = [(gpu, v) for gpu in reading.gpus if (v := judge(gpu)) is not None]
        status = worst_health([v[0] for _, v in verdicts])
        bad = [f"{_label(gpu)} {text}" for gpu, (grade, text) in verdicts if grade is not NodeStatus.HEALTHY]
        details = {str(gpu.get("index")): grade.value for gpu, (grade, _) in verdicts}
        return HealthResult(self.name, status, "; ".join(bad) if bad else ok, details)


class GpuTemperatureCheck(_GpuCheck):
    """Grades the hottest GPU: by default DEGRADED from 85 °C, UNHEALTHY from 90, CRITICAL from 95."""

    name = "gpu_temperature"

    def __init__(self, reader: NvmlReader, thresholds: Thresholds = Thresholds(85.0, 90.0, 95.0), **kw: Any) -> None:
        super().__init__(reader, **kw)
        self.thresholds = thresholds

    def grade(self, reading: GpuReading) -> HealthResult:
        def judge(gpu: dict[str, Any]) -> tuple[NodeStatus, str] | None:
            temp = gpu.get("temperature")
            return None if temp is None else (self.thresholds.grade(temp), f"at {temp:g} °C")

        return self._per_gpu(reading, judge, f"all {len(reading.gpus)} GPUs below {self.thresholds.degraded:g} °C")


class GpuMemoryCheck(_GpuCheck):
    """Grades GPU memory in use. Mild by default (DEGRADED from 95 %, UNHEALTHY from 99 %, never CRITICAL):
    PyTorch's caching allocator keeps memory it freed, so a busy GPU often looks full."""

    name = "gpu_memory"

    def __init__(
        self, reader: NvmlReader, thresholds: Thresholds = Thresholds(95.0, 99.0, float("inf")), **kw: Any
    ) -> None:
        super().__init__(reader, **kw)
        self.thresholds = thresholds

    def grade(self, reading: GpuReading) -> HealthResult:
        def judge(gpu: dict[str, Any]) -> tuple[NodeStatus, str] | None:
            total, used = gpu.get("memory_total"), gpu.get("memory_used")
            if not total or used is None:
                return None
            percent = 100.0 * used / total
            return self.thresholds.grade(percent), f"memory {percent:.1f}% used"

        return self._per_gpu(reading, judge, f"GPU memory below {self.thresholds.degraded:g}% on every GPU")


class GpuErrorCheck(_GpuCheck):
    """Grades hardware errors.

    CRITICAL: the GPU is lost, row remapping failed, or an Xid of :data:`XID_GRADES`
    marked critical. UNHEALTHY: uncorrected ECC errors since the driver loaded.
    DEGRADED: retired pages or remapped rows waiting for a reset, or any other Xid.
    Xid errors count for ``xid_window`` seconds after they happen.
    """

    name = "gpu_errors"

    def __init__(self, reader: NvmlReader, *, xid_window: float = 600.0, **kw: Any) -> None:
        super().__init__(reader, **kw)
        self.xid_window = xid_window

    def grade(self, reading: GpuReading) -> HealthResult:
        def judge(gpu: dict[str, Any]) -> tuple[NodeStatus, str]:
            found: list[tuple[NodeStatus, str]] = []
            if gpu.get("lost"):
                found.append((NodeStatus.CRITICAL, "is lost (fallen off the bus)"))
            if gpu.get("remapped_rows_failed"):
                found.append((NodeStatus.CRITICAL, "row remapping failed"))
            if uncorrected := gpu.get("ecc_uncorrected_volatile"):
                found.append((NodeStatus.UNHEALTHY, f"{uncorrected} uncorrected ECC errors"))
            if gpu.get("retired_pages_pending") or gpu.get("remapped_rows_pending"):
                found.append((NodeStatus.DEGRADED, "memory retirement pending a GPU reset"))
            found.extend(self._xids(gpu))
            if not found:
                return NodeStatus.HEALTHY, "no errors"
            return worst_health([g for g, _ in found]), ", ".join(text for _, text in found)

        return self._per_gpu(reading, judge, f"no hardware errors on {len(reading.gpus)} GPUs")

    def _xids(self, gpu: dict[str, Any]) -> list[tuple[NodeStatus, str]]:
        index = gpu.get("index")
        if not isinstance(index, int):
            return []
        since = time.time() - self.xid_window
        recent = [xid for when, xid in self.reader.xid_events(index) if when >= since]
        if not recent:
            return []
        grade = worst_health([XID_GRADES.get(xid, NodeStatus.DEGRADED) for xid in recent])
        codes = ", ".join(str(x) for x in sorted(set(recent)))
        return [(grade, f"Xid {codes} in the last {self.xid_window:g} s")]
