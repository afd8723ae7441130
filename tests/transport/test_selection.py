"""Selection: ranking, the priority hook, the backend option, negotiation and fallback.

Results come from fake transports (see transport_fakes) probed by the real discovery.
"""

from __future__ import annotations

import pytest
from transport_fakes import FakePriorityPlugin, FakeTransportPlugin, fake_transport

from genie.config import ClusterConfig
from genie.errors import BackendUnavailableError, ConfigError, ConnectError
from genie.transport.base import ProbeTarget
from genie.transport.discovery import discover_sync
from genie.transport.selection import advertised_backends, connect_with_fallback, rank, select
from genie.types import EventType

#: The standard plugins' default ranks (each plugin defines its own: genie_tcp.transport.PRIORITY_TCP, ...).
PRIORITY_DPDK_GPUDEV, PRIORITY_RDMA, PRIORITY_DPDK, PRIORITY_TCP = 400, 300, 200, 100


def fake_standard_backends(*, unavailable: tuple[str, ...] = (), calls: list[str] | None = None,
                           connect_fails: tuple[str, ...] = ()) -> FakeTransportPlugin:
    """Fakes of the four standard backends with their default priorities."""
    table = {"dpdk_gpudev": PRIORITY_DPDK_GPUDEV, "rdma": PRIORITY_RDMA, "dpdk": PRIORITY_DPDK, "tcp": PRIORITY_TCP}
    return FakeTransportPlugin(*(
        fake_transport(name, priority=prio, available=name not in unavailable, calls=calls,
                       connect_fails=name in connect_fails)
        for name, prio in table.items()
    ))


def config(backend: str = "auto", **env: str) -> ClusterConfig:
    return ClusterConfig.from_sources(env, backend=backend) if backend else ClusterConfig.from_sources(env)


def results_of(pm):
    return discover_sync(pm, ProbeTarget(timeout=1.0), use_cache=False).results


def test_default_rank_is_gpudev_rdma_dpdk_tcp(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())
    ranked = rank(results_of(genie_pm), pm=genie_pm, config=config())
    assert [c.name for c in ranked] == ["dpdk_gpudev", "rdma", "dpdk", "tcp"]


def test_unavailable_backends_are_never_ranked(genie_pm, register_plugin):
    register_plugin(fake_standard_backends(unavailable=("dpdk_gpudev", "rdma")))
    selection = select(results_of(genie_pm), pm=genie_pm, config=config())
    assert selection.names == ["dpdk", "tcp"]
    assert "no_devices" in selection.rejected["rdma"]


def test_priority_hook_overrides_the_rank(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())
    register_plugin(FakePriorityPlugin({"tcp": 1000}))
    ranked = rank(results_of(genie_pm), pm=genie_pm, config=config())
    assert ranked[0].name == "tcp" and ranked[0].overridden and ranked[0].priority == 1000
    assert [c.name for c in ranked[1:]] == ["dpdk_gpudev", "rdma", "dpdk"]


def test_priority_hook_must_return_an_int(genie_pm, register_plugin):
    from genie.errors import PluginError

    register_plugin(fake_standard_backends())
    register_plugin(FakePriorityPlugin({"tcp": "high"}))  # type: ignore[dict-item]
    with pytest.raises(PluginError, match="must return an int or None"):
        rank(results_of(genie_pm), pm=genie_pm, config=config())


def test_a_named_backend_is_the_only_candidate(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())
    selection = select(results_of(genie_pm), pm=genie_pm, config=config("dpdk"))
    assert selection.names == ["dpdk"] and selection.explicit
    assert selection.rejected["tcp"] == "not requested (backend='dpdk')"


def test_a_list_keeps_the_users_order(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())
    assert select(results_of(genie_pm), pm=genie_pm, config=config("tcp,rdma")).names == ["tcp", "rdma"]


def test_exclusions_drop_backends_and_keep_the_rank(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())
    selection = select(results_of(genie_pm), pm=genie_pm, config=config("^dpdk,dpdk_gpudev"))
    assert selection.names == ["rdma", "tcp"] and not selection.explicit
    assert "excluded" in selection.rejected["dpdk"]


def test_the_backend_option_comes_from_the_environment(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())
    cfg = ClusterConfig.from_sources({"GENIE_BACKEND": "^rdma"})
    assert select(results_of(genie_pm), pm=genie_pm, config=cfg).names == ["dpdk_gpudev", "dpdk", "tcp"]


@pytest.mark.parametrize("spec", ["infiniband", "tcp,infiniband", "^infiniband"])
def test_unknown_backend_names_are_config_errors(genie_pm, register_plugin, spec):
    register_plugin(fake_standard_backends())
    with pytest.raises(ConfigError, match="installed backends: dpdk, dpdk_gpudev, rdma, tcp"):
        select(results_of(genie_pm), pm=genie_pm, config=config(spec))


def test_an_explicit_backend_that_cannot_be_used_lists_every_reason(genie_pm, register_plugin):
    register_plugin(fake_standard_backends(unavailable=("rdma", "dpdk_gpudev")))
    cfg = ClusterConfig.from_sources({"GENIE_BACKEND": "rdma"})
    with pytest.raises(BackendUnavailableError) as info:
        select(results_of(genie_pm), pm=genie_pm, config=cfg)
    text = str(info.value)
    assert "backend 'rdma' was requested (from environment variable GENIE_BACKEND)" in text
    assert "rdma: unavailable (no_devices): fake rdma says no_devices" in text
    assert "dpdk_gpudev: unavailable (no_devices)" in text
    assert "tcp: not requested" in text and "dpdk: not requested" in text
    assert "does not fall back" in text


def test_a_probe_only_backend_is_not_a_candidate(genie_pm, register_plugin):
    register_plugin(FakeTransportPlugin(
        fake_transport("fake_probe_only", priority=500,
                       details={"data_path": False, "data_path_note": "fake: not implemented"}),
        fake_transport("tcp"),
    ))
    results = results_of(genie_pm)
    assert select(results, pm=genie_pm, config=config()).names == ["tcp"]
    with pytest.raises(BackendUnavailableError, match="fake_probe_only: probe ok, but no data path: fake"):
        select(results, pm=genie_pm, config=config("fake_probe_only"))


# -- negotiation between peers with different plugin sets --------------------------------------

def test_only_backends_both_peers_offer_are_candidates(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())
    results = results_of(genie_pm)
    # The peer has only genie-tcp and genie-dpdk installed, and advertises them best first.
    selection = select(results, pm=genie_pm, config=config(), peer_backends=["dpdk", "tcp"], peer="node fake-b")
    assert selection.names == ["dpdk", "tcp"]
    assert selection.rejected["rdma"] == "not offered by node fake-b (it offers: dpdk, tcp)"


def test_peers_with_different_plugin_sets_agree(genie_pm, register_plugin):
    from genie.plugins import PluginManager

    register_plugin(fake_standard_backends(unavailable=("dpdk_gpudev",)))
    other = PluginManager(autoload=False, environ={})  # a second node: only tcp and rdma installed
    other.register(FakeTransportPlugin(fake_transport("tcp", priority=PRIORITY_TCP),
                                       fake_transport("rdma", priority=PRIORITY_RDMA)), name="fake-node-b")
    mine = select(results_of(genie_pm), pm=genie_pm, config=config())
    theirs = select(results_of(other), pm=other, config=config())
    a_to_b = select(results_of(genie_pm), pm=genie_pm, config=config(), peer_backends=advertised_backends(theirs))
    b_to_a = select(results_of(other), pm=other, config=config(), peer_backends=advertised_backends(mine))
    assert a_to_b.names == b_to_a.names == ["rdma", "tcp"]


def test_no_common_backend_fails_with_every_reason(genie_pm, register_plugin):
    register_plugin(fake_standard_backends(unavailable=("dpdk_gpudev", "rdma", "dpdk")))
    with pytest.raises(BackendUnavailableError, match=r"no usable network backend .*tcp: not offered by the peer"):
        select(results_of(genie_pm), pm=genie_pm, config=config(), peer_backends=["rdma"])


# -- connect with fallback -----------------------------------------------------------------------

def test_connect_falls_back_in_order_and_reports_each_fallback(genie_pm, register_plugin):
    calls: list[str] = []
    register_plugin(fake_standard_backends(calls=calls, connect_fails=("dpdk_gpudev", "rdma")))
    selection = select(results_of(genie_pm), pm=genie_pm, config=config())
    events = []
    outcome = connect_with_fallback(selection, genie_pm.transports(), ("10.0.0.2", 6000), timeout=1.0,
                                    emit=events.append, source="fake-node")
    assert outcome.backend == "dpdk"
    assert [b for b, _ in outcome.fallbacks] == ["dpdk_gpudev", "rdma"]
    assert "fake dpdk_gpudev refuses" in outcome.fallbacks[0][1]
    assert [c for c in calls if c.startswith("connect")] == ["connect:dpdk_gpudev", "connect:rdma", "connect:dpdk"]
    assert [e.type for e in events] == [EventType.BACKEND_FALLBACK, EventType.BACKEND_FALLBACK,
                                        EventType.BACKEND_SELECTED]
    assert events[0].data["from"] == "dpdk_gpudev" and events[0].data["to"] == "rdma"
    assert events[2].data["backend"] == "dpdk" and events[2].source == "fake-node"
    assert [f[0] for f in events[2].data["fallbacks"]] == ["dpdk_gpudev", "rdma"]


def test_connect_uses_the_address_of_each_backend(genie_pm, register_plugin):
    register_plugin(fake_standard_backends(connect_fails=("dpdk_gpudev",)))
    selection = select(results_of(genie_pm), pm=genie_pm, config=config("dpdk_gpudev,tcp"))
    outcome = connect_with_fallback(selection, genie_pm.transports(),
                                    {"dpdk_gpudev": ("h", 1), "tcp": ("h", 2)}, timeout=1.0)
    assert outcome.backend == "tcp" and outcome.channel.peer == "h:2"


def test_an_explicit_request_the_peer_refuses_raises_backend_unavailable(genie_pm, register_plugin):
    base = fake_transport("rdma", priority=PRIORITY_RDMA)

    class Refused(base):
        def connect(self, host, port, *, timeout):
            raise BackendUnavailableError(f"{host}:{port} refused rdma: fake listener without it")

    register_plugin(FakeTransportPlugin(Refused, fake_transport("tcp", priority=PRIORITY_TCP)))
    selection = select(results_of(genie_pm), pm=genie_pm, config=config("rdma"))
    events = []
    with pytest.raises(BackendUnavailableError, match="backend 'rdma' was requested but could not connect"):
        connect_with_fallback(selection, genie_pm.transports(), ("h", 1), timeout=1.0, emit=events.append)
    assert events == []  # nothing to fall back to, nothing selected


def test_an_explicit_request_whose_peer_is_unreachable_raises_connect_error_without_fallback(genie_pm,
                                                                                            register_plugin):
    """Nothing answered on the named backend: the peer is down (a client treats it as a lost node, as under
    auto), which is a ConnectError, not BackendUnavailableError; tcp, installed and not named, is never tried."""
    calls: list[str] = []
    register_plugin(fake_standard_backends(calls=calls, connect_fails=("rdma",)))
    selection = select(results_of(genie_pm), pm=genie_pm, config=config("rdma"))
    with pytest.raises(ConnectError, match="backend 'rdma' was requested but could not connect .*did not answer") \
            as info:
        connect_with_fallback(selection, genie_pm.transports(), ("h", 1), timeout=1.0)
    assert not isinstance(info.value, BackendUnavailableError)
    assert [c for c in calls if c.startswith("connect")] == ["connect:rdma"]


def test_auto_raises_connect_error_when_every_backend_fails(genie_pm, register_plugin):
    register_plugin(fake_standard_backends(connect_fails=("dpdk_gpudev", "rdma", "dpdk", "tcp")))
    selection = select(results_of(genie_pm), pm=genie_pm, config=config())
    with pytest.raises(ConnectError, match="could not connect on any backend") as info:
        connect_with_fallback(selection, genie_pm.transports(), ("h", 1), timeout=1.0)
    assert not isinstance(info.value, BackendUnavailableError)
    for name in ("dpdk_gpudev", "rdma", "dpdk", "tcp"):
        assert f"{name}: connect to h:1 failed" in str(info.value)


def test_a_failing_event_callback_does_not_break_connect(genie_pm, register_plugin):
    register_plugin(fake_standard_backends())

    def broken(event):
        raise RuntimeError("fake sink failure")

    selection = select(results_of(genie_pm), pm=genie_pm, config=config())
    assert connect_with_fallback(selection, genie_pm.transports(), ("h", 1), timeout=1.0, emit=broken).backend \
        == "dpdk_gpudev"


def test_consider_gives_every_reason_without_raising(genie_pm, register_plugin):
    from genie.transport.selection import consider

    register_plugin(FakeTransportPlugin(
        fake_transport("fake_probe_only", details={"data_path": False}), fake_transport("fake_down", available=False)))
    candidates, rejected = consider(results_of(genie_pm), pm=genie_pm, config=config())
    assert candidates == []
    assert rejected["fake_probe_only"].startswith("probe ok, but no data path")
    assert rejected["fake_down"].startswith("unavailable (no_devices)")
