"""The dpdk_gpudev probe, for real, on a host without a gpudev GPU or CUDA (this one and CI)."""

from __future__ import annotations

import anyio
import pytest
from genie_dpdk import eal
from genie_gpudev import transport as gpudev
from genie_gpudev.transport import PRIORITY_DPDK_GPUDEV, GpudevTransport

from genie.errors import BackendUnavailableError
from genie.plugins import PluginManager
from genie.transport.base import ProbeTarget
from genie.types import ProbeResult

libs = eal.find_libraries()
requires_gpudev_lib = pytest.mark.skipif(
    not (libs["eal"] and libs["ethdev"] and libs["gpudev"]),
    reason=f"DPDK 22.11 with librte_gpudev.so.{eal.ABI} is not installed: run scripts/install-system-deps",
)


def probe(timeout: float = 3.0) -> ProbeResult:
    async def body() -> ProbeResult:
        return await GpudevTransport().probe(ProbeTarget(timeout=timeout))

    return anyio.run(body)


def cuda_usable() -> bool:
    return gpudev.cuda_state()[0]


@requires_gpudev_lib
@pytest.mark.skipif(cuda_usable(), reason="this host has CUDA: the absent path is not what happens here")
def test_without_a_gpudev_gpu_and_cuda_every_missing_piece_is_named():
    result = probe()
    assert (result.available, result.reason_code) == (False, "no_devices"), result.reason
    assert result.priority == PRIORITY_DPDK_GPUDEV
    assert "rte_gpu_count_avail() = 0" in result.reason
    assert "CUDA is not available" in result.reason
    assert result.details["gpudev_devices"] == 0 and result.details["stage"] == "done"


def test_missing_dpdk_is_library_missing(monkeypatch):
    monkeypatch.setattr(eal, "LIBRARIES", {k: ("librte_fake_absent.so.23",) for k in eal.LIBRARIES})
    result = probe()
    assert (result.reason_code, result.available) == ("library_missing", False)
    assert "apt install dpdk" in result.reason


@requires_gpudev_lib
def test_missing_gpudev_library_is_named_with_the_other_pieces(monkeypatch):
    names = dict(eal.LIBRARIES, gpudev=("librte_fake_absent_gpudev.so.23",))
    monkeypatch.setattr(eal, "LIBRARIES", names)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = probe()
    assert result.reason_code == "library_missing"
    assert "librte_gpudev.so.23 not found" in result.reason
    assert "CUDA_VISIBLE_DEVICES is empty" in result.reason


def test_an_empty_cuda_visible_devices_means_no_cuda(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpudev.cuda_state() == (False, "CUDA_VISIBLE_DEVICES is empty (no GPU visible)")


def test_the_fingerprint_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    before = GpudevTransport.host_fingerprint()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert GpudevTransport.host_fingerprint() != before


def test_connect_says_the_data_path_is_not_implemented_and_needs_hardware():
    with pytest.raises(BackendUnavailableError, match="not implemented.*rte_gpu_mem_register.*hardware only"):
        GpudevTransport().connect("127.0.0.1", 1, timeout=1.0)


def test_entry_point_registers_dpdk_gpudev():
    pm = PluginManager(environ={"GENIE_PLUGINS": "gpudev"})
    assert pm.transports()["dpdk_gpudev"] is GpudevTransport
