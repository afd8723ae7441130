"""genie-nvml: success paths against a FAKE pynvml module and a FAKE nvidia-smi script; the real
"library not found" path on this machine; the real library on a GPU host (skipped elsewhere); the hooks
and the GPU health checks."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import fake_pynvml
import genie_nvml
import pytest
from fake_pynvml import FakeGpu
from genie_nvml import GpuErrorCheck, GpuMemoryCheck, GpuTemperatureCheck, NvmlReader

from genie.cluster.monitor import ResourceMonitor
from genie.plugins import PluginManager
from genie.types import GPUInfo, NodeInfo, NodeRole, NodeStatus

NODE = NodeInfo("n1", "host", NodeRole.WORKER)


@pytest.fixture
def fake_nvml():
    """The fake pynvml module, reset to two GPUs for each test."""
    fake_pynvml.reset([FakeGpu(), FakeGpu(name="NVIDIA Fake H100", uuid="GPU-fake-1", utilization=95,
                                          temperature=88, power_mw=350_500)])
    yield fake_pynvml
    fake_pynvml.reset()


@pytest.fixture
def reader(fake_nvml):
    r = NvmlReader(module=fake_nvml, nvidia_smi="")
    yield r
    r.close()


# -- NVML through the fake module ------------------------------------------------------------------
def test_fake_nvml_reading_has_every_figure_with_units_converted(reader: NvmlReader) -> None:
    reading = reader.read()
    assert reading.source == "nvml" and reading.driver_version == "550.54.15"
    first, second = reading.gpus
    assert first["name"] == "NVIDIA Fake A100", "bytes names are decoded"
    assert first["uuid"] == "GPU-fake-0" and first["kind"] == "cuda" and first["index"] == 0
    assert (first["memory_total"], first["memory_used"]) == (40 << 30, 10 << 30)
    assert first["utilization"] == 30.0 and first["temperature"] == 55.0
    assert second["power_watts"] == 350.5 and first["power_limit_watts"] == 400.0
    assert (first["clock_graphics_mhz"], first["clock_sm_mhz"], first["clock_memory_mhz"]) == (1410, 1410, 1215)
    assert first["ecc_uncorrected_volatile"] == 0 and first["retired_pages_dbe"] == 0
    assert first["remapped_rows_failed"] is False and first["xid_errors"] == 0
    assert "nvml_errors" not in first
    info = GPUInfo.from_dict(first)
    assert info.memory_total == 40 << 30 and info.utilization == 30.0, "the GPU dicts read as GPUInfo"


def test_fake_nvml_not_supported_figures_are_omitted_silently(fake_nvml, reader: NvmlReader) -> None:
    fake_nvml.state.gpus[0].unsupported = {"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                                           "nvmlDeviceGetPowerUsage", "nvmlDeviceGetRetiredPages"}
    gpu = reader.read().gpus[0]
    for key in ("ecc_corrected_volatile", "remapped_rows_failed", "power_watts", "retired_pages_sbe"):
        assert key not in gpu
    assert "nvml_errors" not in gpu
    assert gpu["temperature"] == 55.0


def test_fake_nvml_other_errors_are_named_and_a_lost_gpu_is_flagged(fake_nvml, reader: NvmlReader) -> None:
    fake_nvml.state.gpus[1].errors = {"nvmlDeviceGetTemperature": fake_nvml.NVML_ERROR_GPU_IS_LOST}
    gpu = reader.read().gpus[1]
    assert gpu["lost"] is True
    assert gpu["nvml_errors"] == {"temperature": "NVMLError: GPU is lost"}
    assert "temperature" not in gpu


def test_fake_nvml_initialises_once_and_reuses_young_readings(fake_nvml, reader: NvmlReader) -> None:
    first = reader.read()
    assert reader.read(max_age=60) is first
    assert reader.read() is not first
    assert fake_nvml.state.init_calls == 1
    reader.close()
    assert fake_nvml.state.shutdown_calls == 1


def test_fake_nvml_xid_errors_are_collected_per_gpu(fake_nvml, reader: NvmlReader) -> None:
    reader.read()
    assert fake_nvml.state.registered == {0, 1}
    fake_nvml.queue_xid(1, 79)
    fake_nvml.queue_xid(1, 13)
    gpus = reader.read().gpus
    assert gpus[0]["xid_errors"] == 0
    assert gpus[1]["xid_errors"] == 2 and gpus[1]["last_xid"] == 13
    assert [x for _, x in reader.xid_events(1)] == [79, 13]


def test_fake_nvml_init_failure_other_than_missing_library_is_the_reason(fake_nvml) -> None:
    fake_nvml.reset(init_error=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED)
    reading = NvmlReader(module=fake_nvml, nvidia_smi="").read()
    assert not reading.available
    assert reading.summary == "unavailable: NVML failed to initialise: NVMLError: Driver Not Loaded"


def test_fake_nvml_through_sys_modules_is_what_the_default_reader_imports(fake_nvml, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml)
    reader = NvmlReader(nvidia_smi="")
    try:
        assert reader.read().source == "nvml"
    finally:
        reader.close()


# -- the real path on this machine ------------------------------------------------------------------
no_nvml_here = pytest.mark.skipif(
    bool(ctypes.util.find_library("nvidia-ml")) or shutil.which("nvidia-smi") is not None,
    reason="this machine has NVML or nvidia-smi",
)


@no_nvml_here
def test_real_pynvml_without_the_library_reports_unavailable_cleanly() -> None:
    reader = NvmlReader()
    reading = reader.read()
    assert reading.source == "none" and reading.gpus == ()
    assert reading.summary == "unavailable: NVML library not found"
    assert reading.fragment() == {"gpus": [], "nvml": {
        "available": False, "source": "none", "status": "unavailable: NVML library not found",
        "reason": "NVML library not found"}}


@no_nvml_here
def test_installed_plugin_loads_through_its_entry_point_and_reports_no_gpus() -> None:
    pm = PluginManager(autoload=True, environ={"GENIE_PLUGINS": "nvml"})
    assert "nvml" in pm.records and pm.records["nvml"].distribution == "genie-nvml"
    assert set(pm.hooks_of("nvml")) == {"genie_node_metrics", "genie_health_checks"}
    monitor = ResourceMonitor(pm, NODE)
    snapshot = monitor.collect()
    assert snapshot.metrics["nvml"]["status"] == "unavailable: NVML library not found"
    assert snapshot.gpus == [] and "cpu_percent" in snapshot.host
    results = [c.check() for c in pm.health_checks() if c.name.startswith("gpu_")]
    assert len(results) == 3
    assert all(r.status is NodeStatus.HEALTHY and "NVML library not found" in r.message for r in results)


def _nvml_works() -> bool:
    """True on a host whose real pynvml initialises (a GPU and its driver): the GPU-host tests below."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception:  # no library, no driver, no GPU: all mean "not a GPU host"
        return False
    return True


gpu_host = pytest.mark.skipif(not _nvml_works(), reason="needs a real NVIDIA GPU and driver (NVML); none here")


def _smi_gpus() -> list[str]:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("GPU ")]


@gpu_host
def test_real_nvml_on_a_gpu_host_reads_every_gpu_nvidia_smi_lists() -> None:
    """REAL GPU: the reader over the real library sees the GPUs ``nvidia-smi -L`` lists, with live figures."""
    listed = _smi_gpus()
    reader = NvmlReader()
    try:
        reading = reader.read()
    finally:
        reader.close()
    assert reading.source == "nvml" and reading.driver_version
    assert len(reading.gpus) == len(listed) >= 1
    for gpu, line in zip(reading.gpus, listed, strict=True):
        assert gpu["name"] in line and gpu["uuid"] in line, (gpu, line)
        assert gpu["memory_total"] >= 1 << 30 and 0 <= gpu["memory_used"] <= gpu["memory_total"]
        assert 0 <= gpu["utilization"] <= 100 and 0 < gpu["temperature"] < 110
        assert gpu["power_watts"] > 0 and gpu["clock_memory_mhz"] > 0
        assert "nvml_errors" not in gpu, gpu["nvml_errors"]


@gpu_host
def test_installed_plugin_on_a_gpu_host_reports_its_gpus_and_grades_them() -> None:
    """REAL GPU: the plugin through its entry point: the monitor's snapshot lists the GPUs, and the three
    GPU checks give a verdict per GPU (a GPU that really is hot or full may grade worse than healthy)."""
    count = len(_smi_gpus())
    pm = PluginManager(autoload=True, environ={"GENIE_PLUGINS": "nvml"})
    snapshot = ResourceMonitor(pm, NODE).collect()
    assert snapshot.metrics["nvml"]["available"] is True and snapshot.metrics["nvml"]["source"] == "nvml"
    assert len(snapshot.gpus) == count and all(g["memory_total"] > 0 for g in snapshot.gpus)
    results = [c.check() for c in pm.health_checks() if c.name.startswith("gpu_")]
    assert len(results) == 3 and all(r.message for r in results)
    assert all(r.status is not NodeStatus.UNHEALTHY for r in results), [r.message for r in results]


# -- nvidia-smi fallback through a FAKE script ---------------------------------------------------------
FAKE_SMI = """\
#!{python}
# FAKE nvidia-smi for tests: records its arguments, prints canned CSV.
import sys
open({log!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
mode = {mode!r}
query = sys.argv[1]
if mode == "fail":
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    sys.exit(9)
if mode == "hang":  # not a wait: a hung nvidia-smi is the behaviour under test (the plugin times it out)
    import time
    time.sleep(30)
if mode == "old" and "clocks.gr" in query:
    print('Field "clocks.gr" is not a valid field to query.')
    sys.exit(2)
if mode == "old":
    print("0, Tesla V100-SXM2-16GB, GPU-old-0, 16160, 100, 3, 41")
    sys.exit(0)
print("0, NVIDIA A100-SXM4-40GB, GPU-aaaa, 40960, 1024, 97, 12, 87, 250.50, 400.00, 1410, 1410, 1215, 0, 0, 0, 550.54.15")
print("1, NVIDIA A100-SXM4-40GB, GPU-bbbb, 40960, 0, 0, 0, 30, [N/A], [Not Supported], 210, 210, 1215, [N/A], [N/A], [N/A], 550.54.15")
"""


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch):
    """Writes a FAKE nvidia-smi into tmp_path, puts it first on PATH; returns (make(mode), log path)."""
    log = tmp_path / "fake-smi-calls.log"

    def make(mode: str = "ok") -> Path:
        path = tmp_path / "nvidia-smi"
        path.write_text(FAKE_SMI.format(python=sys.executable, log=str(log), mode=mode))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    return make, log


@pytest.fixture
def no_library(fake_nvml):
    """The fake pynvml, set to fail as the real one does without libnvidia-ml.so."""
    fake_nvml.reset(init_error=fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    return fake_nvml


def test_fake_nvidia_smi_on_path_is_used_when_the_library_is_missing(no_library, fake_smi) -> None:
    make, log = fake_smi
    make("ok")
    reading = NvmlReader(module=no_library).read()
    assert reading.source == "nvidia-smi" and reading.driver_version == "550.54.15"
    a, b = reading.gpus
    assert a == {
        "kind": "cuda", "index": 0, "name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-aaaa",
        "memory_total": 40960 << 20, "memory_used": 1024 << 20, "utilization": 97.0, "memory_utilization": 12.0,
        "temperature": 87.0, "power_watts": 250.5, "power_limit_watts": 400.0, "clock_graphics_mhz": 1410.0,
        "clock_sm_mhz": 1410.0, "clock_memory_mhz": 1215.0, "ecc_corrected_volatile": 0,
        "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0,
    }
    assert "power_watts" not in b and "ecc_uncorrected_volatile" not in b, "[N/A] values are omitted"
    args = log.read_text().split()
    assert args[0].startswith("--query-gpu=index,name,uuid,") and args[1] == "--format=csv,noheader,nounits"


def test_fake_old_nvidia_smi_refusing_a_field_is_asked_again_with_core_fields(no_library, fake_smi) -> None:
    make, log = fake_smi
    make("old")
    reading = NvmlReader(module=no_library).read()
    assert reading.source == "nvidia-smi"
    assert reading.gpus[0]["name"] == "Tesla V100-SXM2-16GB" and reading.gpus[0]["temperature"] == 41.0
    assert len(log.read_text().splitlines()) == 2


def test_fake_nvidia_smi_failing_or_hanging_is_a_reason_not_an_exception(no_library, fake_smi) -> None:
    make, _ = fake_smi
    make("fail")
    failed = NvmlReader(module=no_library).read()
    assert failed.summary.startswith("unavailable: nvidia-smi failed (exit 9): NVIDIA-SMI has failed")
    make("hang")
    hung = NvmlReader(module=no_library, smi_timeout=0.3).read()
    assert hung.summary == "unavailable: nvidia-smi did not answer within 0.3 s"


def test_library_missing_and_no_nvidia_smi_is_unavailable(no_library, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi
    assert NvmlReader(module=no_library).read().summary == "unavailable: NVML library not found"


# -- hooks ----------------------------------------------------------------------------------------
def test_metrics_hook_returns_the_fragment_and_survives_a_broken_reader(fake_nvml, monkeypatch, genie_pm,
                                                                         register_plugin) -> None:
    monkeypatch.setattr(genie_nvml, "reader", NvmlReader(module=fake_nvml, nvidia_smi=""))
    register_plugin(genie_nvml, "nvml")
    snapshot = ResourceMonitor(genie_pm, NODE).collect()
    assert [g["uuid"] for g in snapshot.gpus] == ["GPU-fake-0", "GPU-fake-1"]
    assert snapshot.metrics["nvml"]["status"] == "nvml: 2 GPUs"

    class Broken:
        def read(self, max_age: float = 0.0) -> None:
            raise RuntimeError("driver surprise")

    monkeypatch.setattr(genie_nvml, "reader", Broken())
    fragment = genie_nvml.genie_node_metrics(node=NODE)
    assert fragment["nvml"]["status"] == "unavailable: reading GPUs failed: RuntimeError: driver surprise"


# -- health checks --------------------------------------------------------------------------------------
def test_fake_nvml_temperature_check_grades_the_hottest_gpu(fake_nvml, reader: NvmlReader) -> None:
    result = GpuTemperatureCheck(reader).check()
    assert result.status is NodeStatus.DEGRADED
    assert result.message == "GPU 1 (NVIDIA Fake H100) at 88 °C"
    fake_nvml.state.gpus[0].temperature = 96
    assert GpuTemperatureCheck(reader, max_age=0).check().status is NodeStatus.CRITICAL
    fake_nvml.state.gpus[0].temperature = fake_nvml.state.gpus[1].temperature = 40
    assert GpuTemperatureCheck(reader, max_age=0).check().status is NodeStatus.HEALTHY


def test_fake_nvml_memory_check_is_mild_about_full_gpus(fake_nvml, reader: NvmlReader) -> None:
    assert GpuMemoryCheck(reader).check().status is NodeStatus.HEALTHY
    fake_nvml.state.gpus[0].memory_used = int(0.97 * fake_nvml.state.gpus[0].memory_total)
    result = GpuMemoryCheck(reader, max_age=0).check()
    assert result.status is NodeStatus.DEGRADED and "memory 97.0% used" in result.message
    fake_nvml.state.gpus[0].memory_used = fake_nvml.state.gpus[0].memory_total
    assert GpuMemoryCheck(reader, max_age=0).check().status is NodeStatus.UNHEALTHY


@pytest.mark.parametrize(
    "setup,status,text",
    [
        (lambda g, f: None, NodeStatus.HEALTHY, "no hardware errors on 2 GPUs"),
        (lambda g, f: setattr(g, "retired_pending", 1), NodeStatus.DEGRADED, "retirement pending"),
        (lambda g, f: g.ecc.update({(1, 0): 2}), NodeStatus.UNHEALTHY, "2 uncorrected ECC errors"),
        (lambda g, f: setattr(g, "remapped", (0, 1, 0, 1)), NodeStatus.CRITICAL, "row remapping failed"),
        (lambda g, f: f.queue_xid(0, 13), NodeStatus.DEGRADED, "Xid 13 in the last 600 s"),
        (lambda g, f: f.queue_xid(0, 79), NodeStatus.CRITICAL, "Xid 79"),
        (lambda g, f: g.errors.update({"nvmlDeviceGetName": 15}), NodeStatus.CRITICAL, "is lost"),
    ],
)
def test_fake_nvml_error_check_grades_hardware_errors(fake_nvml, reader, setup, status, text) -> None:
    reader.read()  # registers the Xid event set
    setup(fake_nvml.state.gpus[0], fake_nvml)
    result = GpuErrorCheck(reader, max_age=0).check()
    assert result.status is status
    assert text in result.message


def test_checks_without_gpu_data_are_healthy_and_say_why(no_library, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    reader = NvmlReader(module=no_library)
    for check in (GpuTemperatureCheck(reader), GpuMemoryCheck(reader), GpuErrorCheck(reader)):
        result = check.check()
        assert result.status is NodeStatus.HEALTHY
        assert result.message == "no GPU data: NVML library not found"


def test_plugin_docstring_is_a_quick_start() -> None:
    doc = textwrap.dedent(genie_nvml.__doc__ or "")
    assert "Quick start" in doc and "pip install genie-nvml" in doc
