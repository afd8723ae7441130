"""Measured figures (genie.transport.measure) over real TCP loopback channels, and ranking by them."""

from __future__ import annotations

import time

import pytest
from genie_tcp import TcpTransport

from genie.config import ClusterConfig
from genie.errors import ConfigError
from genie.transport import measure
from genie.transport.selection import Candidate, by_measured_bandwidth, measured_bandwidth
from genie.types import Figure, ProbeResult


@pytest.fixture(autouse=True)
def _fresh_memory():
    measure.clear_memory_cache()
    yield
    measure.clear_memory_cache()


def tcp_opener(calls: list[int]):
    def opener():
        calls.append(1)
        listener = TcpTransport().listen("127.0.0.1", 0)
        client = TcpTransport().connect("127.0.0.1", listener.port, timeout=5)
        server = listener.accept(timeout=5)
        return client, server, listener.close
    return opener


def test_figures_are_measured_then_cached_per_host_pair(isolated_capability_cache):
    calls: list[int] = []
    figures, cached = measure.measured_figures("tcp", "peer-a", tcp_opener(calls), budget=10, nbytes=1 << 20, rtts=20)
    assert not cached and calls == [1]
    assert figures["bandwidth"].measured and figures["bandwidth"].unit == "Gbit/s" and figures["bandwidth"].value > 0
    assert figures["latency"].measured and figures["latency"].value > 0
    again, cached = measure.measured_figures("tcp", "peer-a", tcp_opener(calls), budget=10)
    assert cached and again == figures and calls == [1]
    measure.clear_memory_cache()  # a new process: the disk cache answers
    assert measure.measured_figures("tcp", "peer-a", tcp_opener(calls), budget=10)[1]
    assert (isolated_capability_cache / "figures.json").exists()
    _, cached = measure.measured_figures("tcp", "peer-b", tcp_opener(calls), budget=10, nbytes=1 << 20, rtts=5)
    assert not cached and calls == [1, 1]


def test_a_measurement_past_its_budget_gives_no_figures_and_is_not_cached():
    calls: list[int] = []
    start = time.monotonic()
    figures, cached = measure.measured_figures("tcp", "slow", tcp_opener(calls), budget=0.0, rtts=10)
    assert figures == {} and not cached and time.monotonic() - start < 5
    measure.measured_figures("tcp", "slow", tcp_opener(calls), budget=0.0, rtts=10)
    assert calls == [1, 1]


def test_a_failing_opener_gives_no_figures():
    def broken():
        raise OSError("no peer")
    assert measure.measured_figures("tcp", "x", broken, budget=1) == ({}, False)


def test_ttl_zero_disables_the_cache_and_bad_values_are_config_errors(monkeypatch):
    monkeypatch.setenv("GENIE_FIGURES_TTL", "0")
    calls: list[int] = []
    for _ in range(2):
        measure.measured_figures("tcp", "p", tcp_opener(calls), budget=10, nbytes=1 << 16, rtts=2)
    assert calls == [1, 1]
    monkeypatch.setenv("GENIE_FIGURES_TTL", "an hour")
    with pytest.raises(ConfigError, match="GENIE_FIGURES_TTL"):
        measure.measured_figures("tcp", "p", tcp_opener(calls), budget=10)


def _candidate(name: str, priority: int, gbit: float | None = None, *, measured: bool = True,
               overridden: bool = False) -> Candidate:
    figures = {} if gbit is None else {"bandwidth": Figure(gbit, "Gbit/s", measured)}
    return Candidate(name, priority, ProbeResult(name, True, "ok", "", priority, figures), overridden)


def test_measured_bandwidth_reorders_only_among_measured_candidates():
    ranked = [_candidate("shm", 500, 5.0), _candidate("dpdk", 200, 100.0, measured=False),
              _candidate("rdma", 300, 20.0), _candidate("tcp", 100)]
    assert [c.name for c in by_measured_bandwidth(ranked)] == ["rdma", "dpdk", "shm", "tcp"]
    assert measured_bandwidth(ranked[1]) is None  # declared figures never rank
    assert measured_bandwidth(_candidate("x", 1, 9.0, overridden=True)) is None  # a hook's choice stands


def test_rank_uses_measured_figures(genie_pm, register_plugin):
    from genie.transport.selection import rank

    results = {c.name: c.result for c in [_candidate("a", 500, 1.0), _candidate("b", 300, 8.0)]}
    assert [c.name for c in rank(results, pm=genie_pm, config=ClusterConfig.from_sources())] == ["b", "a"]
