"""The dpdk transport's probe, for real: DPDK 22.11 EAL in a subprocess (Debian's dpdk package)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio
import pytest
from genie_dpdk import eal, engine
from genie_dpdk.transport import PRIORITY_DPDK, DpdkTransport

from genie.errors import BackendUnavailableError
from genie.plugins import PluginManager
from genie.transport.base import ProbeTarget
from genie.transport.discovery import discover_sync
from genie.types import ProbeResult

requires_dpdk = pytest.mark.skipif(
    not (eal.find_libraries()["eal"] and eal.find_libraries()["ethdev"]),
    reason=f"DPDK 22.11 libraries (librte_eal.so.{eal.ABI}, librte_ethdev.so.{eal.ABI}) are not installed: "
           "run scripts/install-system-deps (apt install dpdk)",
)
#: Tests of what the probe says once its EAL ran: without the shim it says the data path is missing first.
requires_dpdk_and_shim = pytest.mark.skipif(
    not (eal.find_libraries()["eal"] and eal.find_libraries()["ethdev"] and engine.shim_built()),
    reason=f"needs DPDK 22.11 (librte_eal.so.{eal.ABI}) and the shim built at install: run "
           "scripts/install-system-deps (apt install dpdk libdpdk-dev pkg-config), then reinstall genie-dpdk",
)


def probe(timeout: float = 3.0) -> ProbeResult:
    async def body() -> ProbeResult:
        return await DpdkTransport().probe(ProbeTarget(timeout=timeout))

    return anyio.run(body)


def our_runtime_dirs() -> list[str]:
    base = eal._runtime_base()
    stem = f"{eal.PREFIX_STEM}-{os.getpid()}-"
    return [p.name for p in base.iterdir() if p.name.startswith(stem)] if base.exists() else []


@requires_dpdk_and_shim
def test_probe_starts_a_real_eal_and_finds_the_null_port():
    result = probe()
    assert (result.available, result.reason_code) == (True, "ok"), result.reason
    assert result.priority == PRIORITY_DPDK
    assert result.details["ports"] == ["net_null0"]
    assert result.details["dpdk_version"].startswith("DPDK 22.11")
    assert result.details["virtual_ports_only"] is True
    assert result.details["data_path"] is engine.shim_built()
    assert result.details["port_kind"] == "memif (this host only)"
    assert all(not f.measured for f in result.figures.values())


@requires_dpdk
def test_probe_leaves_no_runtime_directory_behind():
    probe()
    assert our_runtime_dirs() == []


@requires_dpdk
def test_eal_init_failure_carries_dpdks_own_message(monkeypatch):
    monkeypatch.setenv("GENIE_DPDK_EAL_ARGS", "--no-huge --no-pci --no-shconf --no-telemetry -m 16 "
                                              "--vdev net_doesnotexist0")
    result = probe()
    assert (result.available, result.reason_code) == (False, "eal_init_failed")
    assert "rte_errno 19" in result.reason and "No such device" in result.reason
    assert "net_doesnotexist0" in result.reason
    assert our_runtime_dirs() == []


@requires_dpdk_and_shim
def test_an_eal_without_ports_says_no_ports(monkeypatch):
    monkeypatch.setenv("GENIE_DPDK_EAL_ARGS", f"--no-huge --no-pci --no-shconf --no-telemetry -m 16 "
                                              f"-l {eal.first_cpu()}")
    result = probe()
    assert (result.available, result.reason_code) == (False, "no_ports")


def test_missing_libraries_are_library_missing_without_a_subprocess(monkeypatch):
    monkeypatch.setattr(eal, "LIBRARIES", {k: ("librte_fake_absent.so.23",) for k in eal.LIBRARIES})
    started = time.perf_counter()
    result = probe()
    assert (result.available, result.reason_code) == (False, "library_missing")
    assert "DPDK library not found: install dpdk (Debian: apt install dpdk)" in result.reason
    assert time.perf_counter() - started < 0.5


def test_an_unloadable_library_is_library_missing_with_the_loader_message(monkeypatch, tmp_path: Path):
    # A fake "library" that is not an ELF file: the loader's own complaint must reach the user.
    for name in (f"librte_eal.so.{eal.ABI}", f"librte_ethdev.so.{eal.ABI}"):
        (tmp_path / name).write_text("fake: not a shared object")
    monkeypatch.setenv("GENIE_DPDK_LIB_DIR", str(tmp_path))
    result = probe()
    assert (result.available, result.reason_code) == (False, "library_missing")
    assert str(tmp_path) in result.reason


def test_a_hung_probe_process_is_killed_and_reaped():
    # not a wait: the child's sleep is the hang under test
    started = time.perf_counter()
    rc, _out, _err, pid = eal.run_probe_process([sys.executable, "-c", "import time; time.sleep(30)"], 0.3)
    assert rc is None and time.perf_counter() - started < 2.0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone and reaped (a zombie would still accept signal 0)


@requires_dpdk
def test_dpdk_and_gpudev_probes_share_one_eal_start():
    first = eal.eal_report(3.0)
    started = time.perf_counter()
    assert eal.eal_report(3.0) is first
    assert time.perf_counter() - started < 0.05


@requires_dpdk
def test_without_the_shim_the_probe_says_dpdk_headers_were_missing_and_connect_refuses(monkeypatch):
    """What a machine without libdpdk-dev sees: the plugin installed, its C shim not built."""
    def no_shim() -> tuple:
        raise BackendUnavailableError(f"{engine.NO_SHIM} (No module named 'genie_dpdk._shim')")

    monkeypatch.setattr(engine, "shim_built", lambda: False)
    monkeypatch.setattr(engine, "load_shim", no_shim)
    result = probe()
    assert (result.available, result.reason_code) == (False, "library_missing")
    assert result.reason.startswith("DPDK headers/libs not found") and "apt install libdpdk-dev" in result.reason
    assert result.details["data_path"] is False
    with pytest.raises(BackendUnavailableError, match="DPDK headers/libs not found"):
        DpdkTransport().connect("127.0.0.1", 1, timeout=1.0)


@requires_dpdk_and_shim
def test_entry_point_discovery_and_the_capability_cache():
    pm = PluginManager(environ={"GENIE_PLUGINS": "dpdk"})
    assert "dpdk" in pm.transports()
    cold = discover_sync(pm, ProbeTarget(timeout=3.0))
    warm = discover_sync(pm, ProbeTarget(timeout=3.0))
    assert cold.results["dpdk"].reason_code == "ok" and cold.cached == frozenset()
    assert warm.cached == {"dpdk"} and warm.results["dpdk"] == cold.results["dpdk"]
    assert warm.elapsed < 0.1


@requires_dpdk_and_shim
def test_a_missing_interface_makes_the_probe_say_no_ports(monkeypatch):
    monkeypatch.setenv("GENIE_DPDK_IFACE", "genie-nosuch0")
    result = probe()
    assert (result.available, result.reason_code) == (False, "no_ports")
    assert "GENIE_DPDK_IFACE='genie-nosuch0': no such network interface" in result.reason
