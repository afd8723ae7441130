"""Placement: the documented score, eligibility, ``prefer``, the genie_placement_score hook, and
genie.device() / the initial current device against real node processes."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

import genie
from genie.cluster.launch import NodeProcess
from genie.cluster.placement import Candidate, choose, default_score
from genie.errors import DeviceError
from genie.plugins import PluginManager
from genie.testing import wait_until
from tests.cluster.conftest import HB, HB_INIT

GIB = 1 << 30


def cand(index: int, **changes: Any) -> Candidate:
    base = Candidate(index=index, node_id=f"n{index}", kind="cuda", name="gpu", status="connected",
                     session_alive=True, health="healthy", memory_free=8 * GIB, memory_total=16 * GIB,
                     utilization=50.0, local_share=0.0, link_rtt=0.001)
    return attrs.evolve(base, **changes)


def test_more_free_memory_and_less_utilisation_win_and_ties_go_to_the_lowest_index() -> None:
    assert choose([cand(0), cand(1, memory_free=12 * GIB)]).index == 1
    assert choose([cand(0), cand(1, utilization=10.0)]).index == 1
    assert choose([cand(0), cand(1)]).index == 0
    assert choose([cand(0), cand(1, health="degraded", memory_free=16 * GIB)]).index == 0


def test_this_clients_data_and_a_short_link_draw_work_to_a_node() -> None:
    assert choose([cand(0), cand(1, local_share=1.0)]).index == 1
    assert choose([cand(0, link_rtt=0.050), cand(1, link_rtt=0.0005)]).index == 1


def test_lost_unhealthy_and_too_small_devices_are_never_chosen() -> None:
    decision = choose([cand(0, status="lost"), cand(1, session_alive=False), cand(2, health="critical"),
                       cand(3, memory_free=GIB), cand(4, utilization=99.0)], min_memory=2 * GIB)
    assert decision.index == 4
    assert set(decision.excluded) == {0, 1, 2, 3}
    with pytest.raises(DeviceError, match=r"remote_accelerator:0: node n0 is lost.*min_memory"):
        choose([cand(0, status="lost"), cand(3, memory_free=GIB)], min_memory=2 * GIB)


def test_prefer_names_a_node_an_index_or_a_kind_but_never_beats_eligibility() -> None:
    cands = [cand(0, memory_free=16 * GIB), cand(1), cand(2, kind="cpu")]
    assert choose(cands, prefer="n1").index == 1
    assert choose(cands, prefer=2).index == 2
    assert choose(cands, prefer="cpu").index == 2
    assert choose([cand(0), cand(1, status="lost")], prefer="n1").index == 0


def test_a_placement_hook_replaces_the_score_and_minus_infinity_excludes() -> None:
    class Site:
        @genie.hookimpl
        def genie_placement_score(self, candidate, default_score, min_memory, prefer):
            if candidate.index == 0:
                return -math.inf
            return 500.0 if candidate.index == 2 else None

    pm = PluginManager(autoload=False)
    pm.register(Site(), name="site-policy")
    decision = choose([cand(0, memory_free=16 * GIB), cand(1), cand(2, utilization=100.0)], pm=pm)
    assert (decision.index, decision.policy, decision.score) == (2, "hook", 500.0)
    assert decision.excluded == {0: "excluded by a genie_placement_score hook"}
    assert dict(decision.scores)[1] == default_score(cand(1))


def test_genie_device_and_the_initial_current_device_follow_placement_on_a_real_cluster() -> None:
    import torch

    from genie.plugins import get_plugin_manager
    from genie.types import EventType

    decisions: list = []
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--node-id", "master", *HB,
                     "--gpu-poll-interval", "0.2") as master, \
            NodeProcess("worker", "--master", f"127.0.0.1:{master.control_port}", "--devices", "cpu,cpu",
                        "--node-id", "w1", *HB, "--gpu-poll-interval", "0.2"):
        port = master.control_port
        state = genie.init_sync(master_addr="127.0.0.1", master_port=port, **HB_INIT)
        try:
            genie.subscribe(decisions.append, types=[EventType.PLACEMENT])
            initial = state.stats["last_placement"]["index"]
            # torch.remote_accelerator is registered at run time: torch's stubs cannot know it
            assert torch.remote_accelerator.current_device() == initial  # type: ignore[attr-defined]
            assert torch.ones(2, device="remote_accelerator").device.index == initial

            chosen = genie.device()
            assert chosen.type == "remote_accelerator" and 0 <= chosen.index < 3
            assert genie.device(prefer="w1").index in (1, 2)
            assert genie.device(prefer=0).index == 0
            wait_until(lambda: len(decisions) >= 3, 5)
            assert decisions[-1].data["device"] == "remote_accelerator:0"

            # Heartbeats carry each node's memory figures: nobody has an exabyte free.
            def refused() -> bool:
                try:
                    genie.device(min_memory=1 << 60)
                except DeviceError as exc:
                    return "min_memory" in str(exc)
                return False

            wait_until(refused, 5, step=0.3)

            class OnlyIndexTwo:
                @genie.hookimpl
                def genie_placement_score(self, candidate, default_score, min_memory, prefer):
                    return 1.0 if candidate.index == 2 else -math.inf

            get_plugin_manager().register(OnlyIndexTwo(), name="only-two")
            try:
                assert genie.device().index == 2
            finally:
                get_plugin_manager().unregister("only-two")
        finally:
            genie.shutdown_sync()
