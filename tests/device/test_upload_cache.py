"""The weight cache end to end: `genie serve` and client processes, `model.to(device)` in new sessions."""

from __future__ import annotations

import json
import stat
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from genie.cluster.launch import NodeProcess
from genie.testing import run_client, wait_until
from tests.conftest import unused_port

# A model whose weights (two 256x512 float32 matrices, 512 KiB each) are above the 64 KiB threshold
# and whose biases are below it. Each step is one session (genie.init ... genie.shutdown): the client
# prints, per session, what went on the wire and what the model computed.
MODEL = """
import json
from genie.device.registry import table

def session(write, read):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 512))
    x = torch.randn(8, 512)
    expected = model(x)
    cpu_sum = float(model[0].weight.sum())  # model.to() moves the parameters themselves: read them first
    dev = "remote_accelerator:0"
    remote = model.to(dev)
    got = remote(x.to(dev)).cpu()
    if write:
        remote[0].weight.data.add_(1.0)
    remote_sum = float(remote[0].weight.sum().cpu()) if read else 0.0
    stats = table().get(0).connection.stats
    return {"up": stats["bytes_up"], "cached": stats["bytes_cached"], "exact": bool(torch.equal(got, expected)),
            "weight_sum": cpu_sum, "remote_sum": remote_sum}

results = []
for write, read in STEPS:
    if results:
        genie.shutdown_sync()
        genie.init_sync(master_addr="127.0.0.1", master_port=PORT, timeout=30)
    results.append(session(write, read))
print("RESULT " + json.dumps(results))
"""
WEIGHTS = 2 * 256 * 512 * 4
BIASES = (256 + 512) * 4


@pytest.fixture(scope="module")
def cache_server() -> Iterator[tuple[NodeProcess, int]]:
    """A `genie serve` with its /metrics endpoint (the weight cache is on by default)."""
    mport = unused_port()
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--metrics-port", str(mport)) as server:
        yield server, mport


def _run(server: NodeProcess, identity: Path, steps: list[tuple[bool, bool]]) -> list[dict[str, Any]]:
    """Run ``steps`` (write in place?, read back?) as sessions of one client process of ``identity``."""
    body = MODEL.replace("STEPS", repr(steps)).replace("PORT", str(server.control_port))
    done = run_client(server.control_port, body, env={"GENIE_CACHE_DIR": str(identity)})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def test_a_new_session_moves_an_already_uploaded_model_without_sending_its_weights(
        cache_server: tuple[NodeProcess, int], tmp_path: Path) -> None:
    """Alice: a first upload; in a new process, a hit, a hit then in-place writes, a hit after those
    writes. Bob, another identity: no hits."""
    server, mport = cache_server
    saved_before = _metric(mport, "genie_server_cache_saved")
    (first,) = _run(server, tmp_path / "alice", [(False, False)])
    assert first["exact"] and first["cached"] == 0 and first["up"] >= WEIGHTS

    second, writer, reader = _run(server, tmp_path / "alice", [(False, False), (True, True), (False, True)])
    assert second["exact"]
    assert second["cached"] == WEIGHTS
    assert second["up"] < first["up"] - WEIGHTS + 1  # only the small biases and the input went on the wire
    wait_until(lambda: _metric(mport, "genie_server_cache_saved") - saved_before >= 3 * WEIGHTS, timeout=10,
               what="the node's /metrics to count the bytes the cache saved")
    assert writer["cached"] == WEIGHTS
    assert writer["remote_sum"] == pytest.approx(writer["weight_sum"] + 256 * 512, rel=1e-4)
    assert reader["cached"] == WEIGHTS and reader["exact"]  # the writer's session changed nothing here
    assert reader["remote_sum"] == pytest.approx(reader["weight_sum"], rel=1e-5, abs=1e-3)

    (bob,) = _run(server, tmp_path / "bob", [(False, False)])  # another user's identity: nothing of alice's
    assert bob["exact"] and bob["cached"] == 0 and bob["up"] >= WEIGHTS


def test_the_policy_picks_parameters_by_default_every_upload_with_all_and_nothing_when_off(tmp_path: Path) -> None:
    from genie.device.transfers import ClientCache

    offer = {"enabled": True, "shared": False, "min_bytes": 64 << 10, "nonce": b"n" * 32}
    assert ClientCache.from_welcome(offer, "off") is None
    assert ClientCache.from_welcome({"enabled": False}, "params") is None
    for scope in (True, False):  # proofs of possession need the session's nonce, in either scope
        assert ClientCache.from_welcome({"enabled": True, "shared": scope, "min_bytes": 1, "nonce": b""}, "all") is None
    params, every = ClientCache.from_welcome(offer, "params"), ClientCache.from_welcome(offer, "all")
    assert params is not None and every is not None
    weight, data = torch.nn.Parameter(torch.zeros(1 << 15)), torch.zeros(1 << 15)
    assert params.wants(weight) and not params.wants(data) and every.wants(data)
    assert not every.wants(torch.zeros(16))  # below the threshold


def test_the_identity_secret_is_one_private_file_per_user(tmp_path: Path) -> None:
    from genie.device.transfers import IDENTITY_FILE, identity_secret

    first = identity_secret(tmp_path)
    assert len(first) == 32 and identity_secret(tmp_path) == first
    path = tmp_path / IDENTITY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)  # readable by others: not trusted, a secret of this process instead
    assert identity_secret(tmp_path) != first
