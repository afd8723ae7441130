"""Reading GPUs: NVML through ``pynvml`` (from nvidia-ml-py), else ``nvidia-smi``, else a reason.

Every call here blocks (NVML talks to the driver, nvidia-smi is a process): the
monitor and the health checker call it from worker threads, never on the event loop.

A GPU is a plain dict (it travels in heartbeats). Always present: ``index``,
``kind`` (``"cuda"``), ``name``. Present where the GPU and driver offer them
(a figure NVML answers NOT_SUPPORTED for is simply left out):

=============================  ==============================================
``uuid``                       ``GPU-...``
``memory_total/used/free``     bytes
``utilization``                % of time a kernel ran (``utilization.gpu``)
``memory_utilization``         % of time memory was read or written
``temperature``                °C (GPU die)
``power_watts``                W drawn now; ``power_limit_watts`` enforced limit
``clock_graphics/sm/memory_mhz``  current clocks, MHz
``ecc_corrected_volatile``     ECC errors since the last driver load
``ecc_uncorrected_volatile``
``ecc_uncorrected_aggregate``  over the board's lifetime
``retired_pages_sbe/dbe``      pages retired for single/double-bit errors
``retired_pages_pending``      a retirement waits for the next reboot
``remapped_rows_corrected/uncorrected/pending/failed``  row remapping (A100 and later)
``xid_errors``                 Xid critical errors seen since genie started; ``last_xid``, ``last_xid_time``
``nvml_errors``                {figure: message} for figures NVML failed on for other reasons
``lost``                       True when NVML says the GPU fell off the bus
=============================  ==============================================
"""

from __future__ import annotations

import collections
import csv
import importlib
import io
import logging
import shutil
import subprocess
import threading
import time
from types import ModuleType
from typing import Any

import attrs

log = logging.getLogger("genie.nvml")

# NVML return codes (stable across versions; read from the error's ``value``).
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
#: Codes meaning "this figure does not exist here": omitted without comment.
_ABSENT = {_NOT_SUPPORTED, _FUNCTION_NOT_FOUND}

#: Fields asked of nvidia-smi, with the dict key and a converter for each.
SMI_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("index", "index", int),
    ("name", "name", str),
    ("uuid", "uuid", str),
    ("memory.total", "memory_total", lambda v: int(float(v) * (1 << 20))),
    ("memory.used", "memory_used", lambda v: int(float(v) * (1 << 20))),
    ("utilization.gpu", "utilization", float),
    ("utilization.memory", "memory_utilization", float),
    ("temperature.gpu", "temperature", float),
    ("power.draw", "power_watts", float),
    ("power.limit", "power_limit_watts", float),
    ("clocks.gr", "clock_graphics_mhz", float),
    ("clocks.sm", "clock_sm_mhz", float),
    ("clocks.mem", "clock_memory_mhz", float),
    ("ecc.errors.corrected.volatile.total", "ecc_corrected_volatile", int),
    ("ecc.errors.uncorrected.volatile.total", "ecc_uncorrected_volatile", int),
    ("ecc.errors.uncorrected.aggregate.total", "ecc_uncorrected_aggregate", int),
    ("driver_version", "driver_version", str),
)
#: Asked again with only these when an older nvidia-smi refuses a field of the full list.
SMI_CORE_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu")
_SMI_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[gpu is lost]"}


@attrs.frozen
class GpuReading:
    """What one read found: the GPUs, where they came from, or why there are none.

    ``source`` is ``"nvml"``, ``"nvidia-smi"`` or ``"none"`` (then ``reason`` says why).
    """

    source: str
    gpus: tuple[dict[str, Any], ...] = ()
    reason: str = ""
    driver_version: str = ""
    timestamp: float = attrs.field(factory=time.monotonic)

    @property
    def available(self) -> bool:
        """True when GPU data could be read (there may still be no GPU)."""
        return self.source != "none"

    @property
    def summary(self) -> str:
        """One line for logs and ``genie plugins``: ``"nvml: 2 GPUs"`` or ``"unavailable: ..."``."""
        if not self.available:
            return f"unavailable: {self.reason}"
        return f"{self.source}: {len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}"

    def fragment(self) -> dict[str, Any]:
        """The ``genie_node_metrics`` fragment: ``{"gpus": [...], "nvml": {...}}``."""
        info: dict[str, Any] = {"available": self.available, "source": self.source, "status": self.summary}
        if self.reason:
            info["reason"] = self.reason
        if self.driver_version:
            info["driver_version"] = self.driver_version
        return {"gpus": [dict(g) for g in self.gpus], "nvml": info}


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Reads every GPU of this host; thread-safe; initialises NVML once and keeps it.

    :param module: the ``pynvml`` module to use (tests pass a fake); default: import ``pynvml``.
    :param nvidia_smi: path of ``nvidia-smi`` for the fallback; default: looked up on PATH
        at the first read; ``""`` disables the fallback.
    :param smi_timeout: seconds an nvidia-smi run may take.
    :param xid_history: Xid events kept per GPU.
    """

    def __init__(
        self, *, module: ModuleType | None = None, nvidia_smi: str | None = None, smi_timeout: float = 5.0,
        xid_history: int = 64,
    ) -> None:
        self._module = module
        self._smi_path = nvidia_smi
        self.smi_timeout = smi_timeout
        self._lock = threading.Lock()
        self._nvml: Any = None  # the initialised module
        self._mode: str | None = None  # "nvml", "nvidia-smi" or "none", decided at the first read
        self._reason = ""
        self._driver = ""
        self._events: Any = None  # NVML event set for Xid errors, when supported
        self._xids: dict[int, collections.deque[tuple[float, int]]] = {}
        self._xid_counts: dict[int, int] = {}
        self._xid_history = xid_history
        self._last: GpuReading | None = None

    # -- public -----------------------------------------------------------------------------
    def read(self, max_age: float = 0.0) -> GpuReading:
        """Read now, or return the previous reading when it is younger than ``max_age`` seconds."""
        with self._lock:
            last = self._last
            if last is not None and max_age > 0 and time.monotonic() - last.timestamp < max_age:
                return last
            if self._mode is None:
                self._start()
            if self._mode == "nvml":
                reading = self._read_nvml()
            elif self._mode == "nvidia-smi":
                reading = self._read_smi()
            else:
                reading = GpuReading("none", reason=self._reason)
            self._last = reading
            return reading

    def xid_events(self, index: int) -> list[tuple[float, int]]:
        """The recent Xid errors of GPU ``index`` as ``(unix time, xid)``, oldest first."""
        with self._lock:
            return list(self._xids.get(index, ()))

    def close(self) -> None:
        """Shut NVML down; the next read starts again from scratch."""
        with self._lock:
            if self._nvml is not None:
                if self._events is not None:
                    self._call_quiet(self._nvml.nvmlEventSetFree, self._events)
                self._call_quiet(self._nvml.nvmlShutdown)
            self._nvml = self._events = self._mode = self._last = None
            self._reason = ""

    # -- choosing a source ------------------------------------------------------------------
    def _start(self) -> None:
        why = self._start_nvml()
        if why is None:
            self._mode = "nvml"
            log.info("reading GPUs through NVML (driver %s)", self._driver or "unknown")
            return
        smi = self._smi_path if self._smi_path is not None else (shutil.which("nvidia-smi") or "")
        if why == "NVML library not found" and smi:
            self._smi_path = smi
            self._mode = "nvidia-smi"
            log.info("NVML library not found; reading GPUs through %s", smi)
            return
        self._mode, self._reason = "none", why
        log.info("GPU metrics unavailable: %s", why)

    def _start_nvml(self) -> str | None:
        """Initialise NVML; None on success, else why not."""
        try:
            nvml = self._module if self._module is not None else importlib.import_module("pynvml")
        except ImportError:
            return "NVML library not found"  # nvidia-ml-py itself is missing: same remedy
        try:
            nvml.nvmlInit()
        except Exception as exc:
            if _code(exc) == _LIBRARY_NOT_FOUND:
                return "NVML library not found"
            return f"NVML failed to initialise: {type(exc).__name__}: {exc}"
        self._nvml = nvml
        self._driver = _text(self._call_quiet(nvml.nvmlSystemGetDriverVersion) or "")
        self._register_xid_events()
        return None

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        xid_type = getattr(nvml, "nvmlEventTypeXidCriticalError", None)
        if xid_type is None:
            return
        try:
            events = nvml.nvmlEventSetCreate()
        except Exception as exc:
            log.debug("no NVML event set, Xid errors not watched: %s", exc)
            return
        registered = 0
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index), xid_type, events)
                registered += 1
            except Exception as exc:
                log.debug("GPU %d: Xid events not watched: %s", index, exc)
        if registered:
            self._events = events
        else:
            self._call_quiet(nvml.nvmlEventSetFree, events)

    @staticmethod
    def _call_quiet(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            log.debug("%s failed: %s", getattr(fn, "__name__", fn), exc)
            return None

    # -- NVML -------------------------------------------------------------------------------
    def _read_nvml(self) -> GpuReading:
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            return GpuReading("none", reason=f"NVML could not count GPUs: {type(exc).__name__}: {exc}")
        self._drain_xid_events()
        gpus = tuple(self._read_device(index) for index in range(count))
        return GpuReading("nvml", gpus, driver_version=self._driver)

    def _read_device(self, index: int) -> dict[str, Any]:
        nvml = self._nvml
        gpu: dict[str, Any] = {"index": index, "kind": "cuda", "name": ""}
        errors: dict[str, str] = {}
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            gpu["lost"] = _code(exc) == _GPU_IS_LOST
            gpu["nvml_errors"] = {"handle": f"{type(exc).__name__}: {exc}"}
            return gpu

        def get(field: str, fn: Any, *args: Any) -> Any:
            try:
                return fn(handle, *args)
            except Exception as exc:
                code = _code(exc)
                if code is None:
                    raise  # not an NVML error: a bug, let it show
                if code == _GPU_IS_LOST:
                    gpu["lost"] = True
                if code not in _ABSENT:
                    errors[field] = f"{type(exc).__name__}: {exc}"
                return None

        if (name := get("name", nvml.nvmlDeviceGetName)) is not None:
            gpu["name"] = _text(name)
        if (uuid := get("uuid", nvml.nvmlDeviceGetUUID)) is not None:
            gpu["uuid"] = _text(uuid)
        if (mem := get("memory", nvml.nvmlDeviceGetMemoryInfo)) is not None:
            gpu.update(memory_total=int(mem.total), memory_used=int(mem.used), memory_free=int(mem.free))
        if (rates := get("utilization", nvml.nvmlDeviceGetUtilizationRates)) is not None:
            gpu.update(utilization=float(rates.gpu), memory_utilization=float(rates.memory))
        if (temp := get("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)) is not None:
            gpu["temperature"] = float(temp)
        if (power := get("power", nvml.nvmlDeviceGetPowerUsage)) is not None:
            gpu["power_watts"] = power / 1000.0  # NVML reports milliwatts
        if (limit := get("power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit)) is not None:
            gpu["power_limit_watts"] = limit / 1000.0
        for key, clock in (("clock_graphics_mhz", "NVML_CLOCK_GRAPHICS"), ("clock_sm_mhz", "NVML_CLOCK_SM"),
                           ("clock_memory_mhz", "NVML_CLOCK_MEM")):
            if (mhz := get(key, nvml.nvmlDeviceGetClockInfo, getattr(nvml, clock))) is not None:
                gpu[key] = float(mhz)
        for key, kind, counter in (
            ("ecc_corrected_volatile", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
            ("ecc_uncorrected_volatile", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
            ("ecc_uncorrected_aggregate", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
        ):
            value = get(key, nvml.nvmlDeviceGetTotalEccErrors, getattr(nvml, kind), getattr(nvml, counter))
            if value is not None:
                gpu[key] = int(value)
        for key, cause in (("retired_pages_sbe", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
                           ("retired_pages_dbe", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")):
            if (pages := get(key, nvml.nvmlDeviceGetRetiredPages, getattr(nvml, cause))) is not None:
                gpu[key] = len(pages)
        if (pending := get("retired_pages_pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus)) is not None:
            gpu["retired_pages_pending"] = bool(pending)
        if (rows := get("remapped_rows", nvml.nvmlDeviceGetRemappedRows)) is not None:
            corrected, uncorrected, rows_pending, failed = rows
            gpu.update(remapped_rows_corrected=int(corrected), remapped_rows_uncorrected=int(uncorrected),
                       remapped_rows_pending=bool(rows_pending), remapped_rows_failed=bool(failed))
        if self._events is not None:
            gpu["xid_errors"] = self._xid_counts.get(index, 0)
            if recent := self._xids.get(index):
                gpu["last_xid_time"], gpu["last_xid"] = recent[-1]
        if errors:
            gpu["nvml_errors"] = errors
        return gpu

    def _drain_xid_events(self) -> None:
        """Collect the Xid errors NVML queued since the last read, without waiting."""
        if self._events is None:
            return
        nvml = self._nvml
        for _ in range(1000):  # bounded: a storm of Xids must not stall the poll
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)
            except Exception as exc:
                if _code(exc) != _TIMEOUT:
                    log.debug("reading NVML events failed: %s", exc)
                return
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except Exception:
                index = -1
            xid = int(data.eventData)
            self._xids.setdefault(index, collections.deque(maxlen=self._xid_history)).append((time.time(), xid))
            self._xid_counts[index] = self._xid_counts.get(index, 0) + 1
            log.warning("GPU %d: Xid %d", index, xid)

    # -- nvidia-smi -------------------------------------------------------------------------
    def _read_smi(self) -> GpuReading:
        fields = [f for f, _, _ in SMI_FIELDS]
        rows, error = self._run_smi(fields)
        if error is not None and "not a valid field" in error.lower():
            fields = list(SMI_CORE_FIELDS)
            rows, error = self._run_smi(fields)
        if error is not None:
            return GpuReading("none", reason=error)
        convert = {f: (key, conv) for f, key, conv in SMI_FIELDS}
        gpus = []
        driver = ""
        for row in rows:
            gpu: dict[str, Any] = {"kind": "cuda", "name": ""}
            for field, raw in zip(fields, row, strict=False):  # short rows: missing trailing fields
                key, conv = convert[field]
                value = raw.strip()
                if value.lower() in _SMI_MISSING:
                    continue
                try:
                    gpu[key] = conv(value)
                except ValueError:
                    log.debug("nvidia-smi %s: unreadable value %r", field, value)
            driver = str(gpu.pop("driver_version", driver))
            if "index" in gpu:
                gpus.append(gpu)
        return GpuReading("nvidia-smi", tuple(gpus), driver_version=driver)

    def _run_smi(self, fields: list[str]) -> tuple[list[list[str]], str | None]:
        argv = [self._smi_path or "nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.smi_timeout, check=False)
        except subprocess.TimeoutExpired:
            return [], f"nvidia-smi did not answer within {self.smi_timeout:g} s"
        except OSError as exc:
            return [], f"nvidia-smi could not run: {exc}"
        if done.returncode != 0:
            text = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[0]
            return [], f"nvidia-smi failed (exit {done.returncode}): {text}"
        rows = [row for row in csv.reader(io.StringIO(done.stdout), skipinitialspace=True) if row]
        return rows, None
