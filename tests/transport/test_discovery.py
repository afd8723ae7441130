"""Discovery: concurrent probes within a deadline, and the host-capability cache."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from transport_fakes import FakeTransportPlugin, fake_transport

from genie.testing import wait_until
from genie.transport.base import ProbeTarget
from genie.transport.cache import CapabilityCache
from genie.transport.discovery import discover_sync
from genie.types import ProbeResult


def test_every_installed_transport_gets_one_result(genie_pm, register_plugin):
    register_plugin(FakeTransportPlugin(fake_transport("fake_a"), fake_transport("fake_b", available=False)))
    found = discover_sync(genie_pm, ProbeTarget(timeout=2.0))
    assert list(found.results) == ["fake_a", "fake_b"]
    assert found.results["fake_a"].available
    assert found.results["fake_b"].reason_code == "no_devices"
    assert [r.name for r in found.available] == ["fake_a"]


def test_probes_run_concurrently(genie_pm, register_plugin):
    names = [f"fake_slow{i}" for i in range(4)]
    register_plugin(FakeTransportPlugin(*(fake_transport(n, sleep=0.3) for n in names)))
    started = time.perf_counter()
    found = discover_sync(genie_pm, ProbeTarget(timeout=2.0))
    assert time.perf_counter() - started < 0.9  # 4 x 0.3 s one after the other would be 1.2 s
    assert all(found.results[n].available for n in names)


def test_an_awaiting_hung_probe_times_out_at_the_deadline(genie_pm, register_plugin):
    register_plugin(FakeTransportPlugin(fake_transport("fake_hang", sleep=30), fake_transport("fake_ok")))
    started = time.perf_counter()
    found = discover_sync(genie_pm, ProbeTarget(timeout=0.3))
    assert time.perf_counter() - started < 0.8
    assert found.results["fake_hang"].reason_code == "timeout"
    assert not found.results["fake_hang"].available
    assert "0.3 s" in found.results["fake_hang"].reason
    assert found.results["fake_ok"].available


def test_a_probe_blocking_its_thread_cannot_delay_discovery(genie_pm, register_plugin):
    # time.sleep inside an async probe blocks an event loop; each probe has its own thread and loop.
    register_plugin(FakeTransportPlugin(fake_transport("fake_blocking", block=2.0), fake_transport("fake_ok")))
    started = time.perf_counter()
    found = discover_sync(genie_pm, ProbeTarget(timeout=0.3))
    assert time.perf_counter() - started < 0.8
    assert found.results["fake_blocking"].reason_code == "timeout"
    assert found.results["fake_ok"].available
    stuck = [t for t in threading.enumerate() if t.name == "genie-probe-fake_blocking"]
    assert all(t.daemon for t in stuck)  # abandoned threads never block interpreter exit


def test_a_raising_probe_becomes_an_error_result(genie_pm, register_plugin):
    register_plugin(FakeTransportPlugin(fake_transport("fake_boom", raises=RuntimeError("fake library exploded"))))
    found = discover_sync(genie_pm, ProbeTarget(timeout=1.0))
    result = found.results["fake_boom"]
    assert (result.available, result.reason_code) == (False, "error")
    assert "RuntimeError: fake library exploded" in result.reason


def test_a_probe_returning_the_wrong_name_is_an_error(genie_pm, register_plugin):
    cls = fake_transport("fake_named")
    cls.name = "fake_renamed"  # the class now claims another name than its probe reports
    register_plugin(FakeTransportPlugin(cls))
    result = discover_sync(genie_pm, ProbeTarget(timeout=1.0)).results["fake_renamed"]
    assert result.reason_code == "error" and "plugin bug" in result.reason


def test_a_zero_priority_result_gets_the_class_default(genie_pm, register_plugin):
    cls = fake_transport("fake_default", priority=0)
    cls.default_priority = 250
    register_plugin(FakeTransportPlugin(cls))
    assert discover_sync(genie_pm, ProbeTarget(timeout=1.0)).results["fake_default"].priority == 250


# -- the host-capability cache ----------------------------------------------------------------

def test_host_only_results_are_cached_and_peer_results_are_not(genie_pm, register_plugin):
    calls: list[str] = []
    register_plugin(FakeTransportPlugin(
        fake_transport("fake_host", fingerprint={"lib": "v1"}, calls=calls),
        fake_transport("fake_peer", calls=calls),  # no fingerprint: depends on the peer, like TCP's RTT
    ))
    first = discover_sync(genie_pm, ProbeTarget(timeout=1.0))
    second = discover_sync(genie_pm, ProbeTarget(timeout=1.0))
    assert first.cached == frozenset() and second.cached == {"fake_host"}
    assert calls.count("probe:fake_host") == 1
    assert calls.count("probe:fake_peer") == 2
    assert second.results["fake_host"] == first.results["fake_host"]


def test_a_changed_fingerprint_is_a_miss(genie_pm, register_plugin):
    calls: list[str] = []
    fingerprint = {"lib": ["/usr/lib/libfake.so", 1]}
    cls = fake_transport("fake_host", fingerprint=fingerprint, calls=calls)
    register_plugin(FakeTransportPlugin(cls))
    discover_sync(genie_pm, ProbeTarget(timeout=1.0))
    cls.host_fingerprint = classmethod(lambda c: {"lib": ["/usr/lib/libfake.so", 2]})  # the library was upgraded
    found = discover_sync(genie_pm, ProbeTarget(timeout=1.0))
    assert found.cached == frozenset()
    assert calls.count("probe:fake_host") == 2


def test_a_changed_plugin_version_is_a_miss(genie_pm, register_plugin):
    calls: list[str] = []
    register_plugin(FakeTransportPlugin(fake_transport("fake_host", fingerprint={}, calls=calls)), name="fakeplug")
    discover_sync(genie_pm, ProbeTarget(timeout=1.0))
    record = genie_pm.records["fakeplug"]
    genie_pm.records["fakeplug"] = type(record)(record.name, "fake-dist", "9.9", record.path, record.builtin)
    assert discover_sync(genie_pm, ProbeTarget(timeout=1.0)).cached == frozenset()


def test_the_cache_persists_on_disk_across_processes(genie_pm, register_plugin, isolated_capability_cache: Path):
    calls: list[str] = []
    register_plugin(FakeTransportPlugin(fake_transport("fake_host", fingerprint={"x": 1}, calls=calls)))
    discover_sync(genie_pm, ProbeTarget(timeout=1.0), cache=CapabilityCache())
    doc = json.loads((isolated_capability_cache / "capabilities.json").read_text())
    assert doc["entries"]["fake_host"]["result"]["name"] == "fake_host"
    # A fresh cache object reads the file, as a new process would.
    found = discover_sync(genie_pm, ProbeTarget(timeout=1.0), cache=CapabilityCache())
    assert found.cached == {"fake_host"} and calls.count("probe:fake_host") == 1


def test_timeouts_and_errors_are_never_cached(genie_pm, register_plugin):
    calls: list[str] = []
    register_plugin(FakeTransportPlugin(
        fake_transport("fake_hang", fingerprint={}, sleep=5, calls=calls),
        fake_transport("fake_boom", fingerprint={}, raises=OSError("fake"), calls=calls),
    ))
    discover_sync(genie_pm, ProbeTarget(timeout=0.2))
    found = discover_sync(genie_pm, ProbeTarget(timeout=0.2))
    assert found.cached == frozenset()
    # Each round's probe runs on a thread of its own, abandoned at the timeout: on a loaded machine its event loop
    # may start (and record the call) only after the round gave up on it, so wait for both rounds' records.
    wait_until(lambda: calls.count("probe:fake_hang") >= 2, 10, what="both rounds' probes of fake_hang started")
    assert calls.count("probe:fake_hang") == 2 and calls.count("probe:fake_boom") == 2


def test_refresh_and_disable_bypass_the_cache(genie_pm, register_plugin, monkeypatch):
    calls: list[str] = []
    register_plugin(FakeTransportPlugin(fake_transport("fake_host", fingerprint={}, calls=calls)))
    discover_sync(genie_pm, ProbeTarget(timeout=1.0))
    assert discover_sync(genie_pm, ProbeTarget(timeout=1.0), refresh=True).cached == frozenset()
    monkeypatch.setenv("GENIE_CAPABILITY_CACHE", "0")
    assert discover_sync(genie_pm, ProbeTarget(timeout=1.0)).cached == frozenset()
    assert calls.count("probe:fake_host") == 3


def test_a_corrupt_cache_file_is_ignored(genie_pm, register_plugin, isolated_capability_cache: Path, caplog):
    isolated_capability_cache.mkdir(parents=True)
    (isolated_capability_cache / "capabilities.json").write_text("{not json")
    register_plugin(FakeTransportPlugin(fake_transport("fake_host", fingerprint={})))
    found = discover_sync(genie_pm, ProbeTarget(timeout=1.0), cache=CapabilityCache())
    assert found.results["fake_host"].available
    assert "ignoring unreadable capability cache" in caplog.text
    json.loads((isolated_capability_cache / "capabilities.json").read_text())  # rewritten whole


def test_cache_round_trips_a_result(tmp_path: Path):
    from genie.types import Figure

    result = ProbeResult("fake_x", True, "ok", "fine", 123, {"rtt": Figure(0.5, "ms", True)}, {"ports": ["a"]})
    CapabilityCache(tmp_path).put("fake_x", "k1", result)
    again = CapabilityCache(tmp_path)
    assert again.get("fake_x", "k1") == result
    assert again.get("fake_x", "k2") is None
    again.clear()
    assert CapabilityCache(tmp_path).get("fake_x", "k1") is None


def test_warm_discovery_is_cheap(genie_pm, register_plugin):
    timeout = 0.25
    register_plugin(FakeTransportPlugin(*(fake_transport(f"fake_h{i}", fingerprint={"i": i}) for i in range(4))))
    discover_sync(genie_pm, ProbeTarget(timeout=timeout))
    found = discover_sync(genie_pm, ProbeTarget(timeout=timeout))
    assert len(found.cached) == 4
    assert found.elapsed < 0.05  # the target is 20 ms; this bound only catches gross regressions
