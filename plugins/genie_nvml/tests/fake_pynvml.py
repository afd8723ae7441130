"""FAKE stand-in for the ``pynvml`` module (nvidia-ml-py), for tests on machines without a GPU.

It mimics the slice of the pynvml API that genie_nvml uses: same function names,
constants, error classes carrying the NVML return code in ``.value``, milliwatts
for power. Tests describe GPUs with :class:`FakeGpu` and call :func:`reset`;
nothing here talks to a driver.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import attrs

NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
nvmlEventTypeXidCriticalError = 0x8

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

_MESSAGES = {3: "Not Supported", 9: "Driver Not Loaded", 10: "Timeout", 12: "NVML Shared Library Not Found",
             15: "GPU is lost", 999: "Unknown Error"}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's own spelling
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_LIBRARY_NOT_FOUND)


class NVMLError_Timeout(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_TIMEOUT)


@attrs.define
class FakeGpu:
    """One fake GPU. ``unsupported`` names functions that answer NOT_SUPPORTED; ``errors`` maps
    function names to an NVML code they fail with."""

    name: str = "NVIDIA Fake A100"
    uuid: str = "GPU-fake-0"
    memory_total: int = 40 << 30
    memory_used: int = 10 << 30
    utilization: int = 30
    memory_utilization: int = 20
    temperature: int = 55
    power_mw: int = 120_000
    power_limit_mw: int = 400_000
    clocks: dict[int, int] = attrs.field(factory=lambda: {0: 1410, 1: 1410, 2: 1215})
    ecc: dict[tuple[int, int], int] = attrs.field(factory=dict)
    retired: dict[int, list[int]] = attrs.field(factory=dict)
    retired_pending: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    unsupported: set[str] = attrs.field(factory=set)
    errors: dict[str, int] = attrs.field(factory=dict)


state = SimpleNamespace(gpus=[], init_error=None, init_calls=0, shutdown_calls=0, events=[], registered=set())


def reset(gpus: list[FakeGpu] | None = None, *, init_error: int | None = None) -> None:
    """Start over with these GPUs (none by default); ``init_error`` makes nvmlInit fail with that code."""
    state.gpus = list(gpus or [])
    state.init_error = init_error
    state.init_calls = state.shutdown_calls = 0
    state.events = []
    state.registered = set()


def queue_xid(index: int, xid: int) -> None:
    """Make the next event-set wait return an Xid critical error on GPU ``index``."""
    state.events.append(SimpleNamespace(device=("handle", index), eventType=nvmlEventTypeXidCriticalError,
                                        eventData=xid))


def _gpu(handle: Any, fn: str) -> FakeGpu:
    gpu = state.gpus[handle[1]]
    if fn in gpu.unsupported:
        raise NVMLError_NotSupported()
    if fn in gpu.errors:
        raise NVMLError(gpu.errors[fn])
    return gpu


def nvmlInit() -> None:
    state.init_calls += 1
    if state.init_error is not None:
        raise NVMLError(state.init_error)


def nvmlShutdown() -> None:
    state.shutdown_calls += 1


def nvmlSystemGetDriverVersion() -> str:
    return "550.54.15"


def nvmlDeviceGetCount() -> int:
    return len(state.gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> tuple[str, int]:
    if index >= len(state.gpus):
        raise NVMLError(2)
    return ("handle", index)


def nvmlDeviceGetIndex(handle: Any) -> int:
    return handle[1]


def nvmlDeviceGetName(handle: Any) -> bytes:
    return _gpu(handle, "nvmlDeviceGetName").name.encode()  # older pynvml returns bytes


def nvmlDeviceGetUUID(handle: Any) -> str:
    return _gpu(handle, "nvmlDeviceGetUUID").uuid


def nvmlDeviceGetMemoryInfo(handle: Any) -> Any:
    g = _gpu(handle, "nvmlDeviceGetMemoryInfo")
    return SimpleNamespace(total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used)


def nvmlDeviceGetUtilizationRates(handle: Any) -> Any:
    g = _gpu(handle, "nvmlDeviceGetUtilizationRates")
    return SimpleNamespace(gpu=g.utilization, memory=g.memory_utilization)


def nvmlDeviceGetTemperature(handle: Any, sensor: int) -> int:
    assert sensor == NVML_TEMPERATURE_GPU
    return _gpu(handle, "nvmlDeviceGetTemperature").temperature


def nvmlDeviceGetPowerUsage(handle: Any) -> int:
    return _gpu(handle, "nvmlDeviceGetPowerUsage").power_mw


def nvmlDeviceGetEnforcedPowerLimit(handle: Any) -> int:
    return _gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw


def nvmlDeviceGetClockInfo(handle: Any, clock: int) -> int:
    return _gpu(handle, "nvmlDeviceGetClockInfo").clocks[clock]


def nvmlDeviceGetTotalEccErrors(handle: Any, error_type: int, counter_type: int) -> int:
    return _gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc.get((error_type, counter_type), 0)


def nvmlDeviceGetRetiredPages(handle: Any, cause: int) -> list[int]:
    return list(_gpu(handle, "nvmlDeviceGetRetiredPages").retired.get(cause, []))


def nvmlDeviceGetRetiredPagesPendingStatus(handle: Any) -> int:
    return _gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus").retired_pending


def nvmlDeviceGetRemappedRows(handle: Any) -> tuple[int, int, int, int]:
    return _gpu(handle, "nvmlDeviceGetRemappedRows").remapped


def nvmlEventSetCreate() -> str:
    return "event-set"


def nvmlDeviceRegisterEvents(handle: Any, event_types: int, event_set: Any) -> None:
    _gpu(handle, "nvmlDeviceRegisterEvents")
    state.registered.add(handle[1])


def nvmlEventSetWait(event_set: Any, timeout_ms: int) -> Any:
    if not state.events:
        raise NVMLError_Timeout()
    return state.events.pop(0)


def nvmlEventSetFree(event_set: Any) -> None:
    pass
