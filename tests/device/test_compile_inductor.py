"""Replayed graphs compiled by inductor on the node (``genie serve --compile-replays inductor``), against real
node processes on a CPU server: inductor generates C++ for the CPU and compiles it with the host's gcc.

A signature's first replay runs node by node (checked in full: genie.server.graph_gate); the next one is
admitted and compiles the graph; later ones run the compiled code. The node logs each outcome
(genie.server.inductor_replays), which the tests read: compiled, stayed node by node (and why), failed once.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from genie.cluster.launch import NodeProcess
from genie.testing import run_client, wait_until

D0 = "remote_accelerator:0"
COMPILED = re.compile(r"graph (\d+) compiled by inductor in [\d.]+ s")


def _serve(*extra: str, env: dict[str, str] | None = None) -> NodeProcess:
    # --log-level goes before the subcommand: the node logs its sessions' INFO lines (the outcomes read here)
    return NodeProcess("--log-level", "INFO", "serve", "--port", "0", "--devices", "cpu", "--compile-replays",
                       "inductor", *extra, env=env)


@pytest.fixture(scope="module")
def server() -> Iterator[NodeProcess]:
    """One node that compiles replays with inductor, and this process's genie connected to it."""
    import genie

    with _serve() as node:
        genie.init_sync(master_addr="127.0.0.1", master_port=node.control_port, timeout=30)
        try:
            yield node
        finally:
            genie.shutdown_sync()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _lines(node: NodeProcess, text: str) -> list[str]:
    return [line for line in node.log().splitlines() if text in line]


def _compiled(node: NodeProcess) -> set[int]:
    return {int(m.group(1)) for m in COMPILED.finditer(node.log())}


@pytest.mark.slow
def test_a_training_step_compiled_by_inductor_on_the_node_equals_the_eager_replay(server: NodeProcess) -> None:
    """Forward, backward and a capturable AdamW step (its foreach ops write the parameters and moments, graph
    inputs, in place), each one replay. Steps 1 to 3 run node by node (the second queues the model's compiles;
    the optimizer's graph of later steps, recompiled by dynamo after its state was made in step 1, is admitted
    at step 3); once the node has compiled the three graphs, steps 4 and 5 run inductor's code. Eager replays equal local CPU
    execution bit for bit (tests/device/test_compile.py); compiled ones round differently in the last bits
    (inductor fuses the pointwise ops and vectorises the reductions), so the comparison is a tight tolerance."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 4))
    batches = [torch.randn(5, 8) for _ in range(5)]

    def train(device: str, backend: str | None, between: Any = lambda: None) -> list[torch.Tensor]:
        torch._dynamo.reset()
        m = copy.deepcopy(model).to(device)
        run = torch.compile(m, backend=backend) if backend else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=backend is not None)
        step = torch.compile(opt.step, backend=backend) if backend else opt.step
        losses = []
        for i, x in enumerate(batches):
            if i == 3:
                between()
            opt.zero_grad()
            loss = run(x.to(device)).pow(2).mean()
            loss.backward()
            step()
            losses.append(loss.detach().cpu())
        return losses + [p.detach().cpu() for p in m.parameters()]

    before = _compiled(server)

    def compiled_three() -> None:
        try:
            wait_until(lambda: len(_compiled(server) - before) >= 3, timeout=240,
                       what="the node to compile the forward, backward and optimizer graphs")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the node's lines: {_lines(server, 'genie.server.inductor')}") from None

    remote = train(D0, "genie", compiled_three)
    local = train("cpu", None)
    assert len(_compiled(server) - before) == 3
    for a, b in zip(remote, local, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not _lines(server, "inductor could not compile")


def test_a_graph_with_dropout_compiles_drawing_from_the_session_generator(server: NodeProcess) -> None:
    """Dropout draws from the session's generator: its graph compiles, and the compiled code draws a new mask each
    replay (inductor's seeds from the session's state: genie.server.inductor_replays._session_draws)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, training=True) * 2

    x = torch.ones(4096).to(D0)
    run = torch.compile(f, backend="genie")
    before = _compiled(server)
    run(x)  # checked in full; the next replay is admitted and queues the compile
    wait_until(lambda: (run(x), len(_compiled(server) - before))[1] == 1, timeout=120,
               what="the node to compile the dropout graph")
    outs = [run(x).cpu() for _ in range(3)]  # compiled
    for o in outs:
        assert set(o.unique().tolist()) <= {0.0, 4.0}
        assert 0.4 < float((o > 0).float().mean()) < 0.6
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    assert not _lines(server, "draws random numbers from a generator other than the session's")


def test_a_string_argument_outside_the_reviewed_values_stays_node_by_node(server: NodeProcess) -> None:
    """linalg.eigh(UPLO='U') reaches the graph as aten::_linalg_eigh(A, 'U', ...): 'U' is text from the client,
    which generated code never carries, and UPLO is no argument of the reviewed list."""
    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.linalg.eigh(a + a.mT, UPLO="U").eigenvalues * 2

    a = torch.randn(4, 4)
    run = torch.compile(f, backend="genie")
    for _ in range(3):
        torch.testing.assert_close(run(a.to(D0)).cpu(), torch.linalg.eigh(a + a.mT).eigenvalues * 2)
    line = wait_until(lambda: _lines(server, "string argument 'UPLO' outside the reviewed values"), timeout=10,
                      what="the node to log that the eigh graph stays node by node")
    assert "aten::_linalg_eigh" in line[0]


@pytest.mark.slow
def test_an_embedding_bag_compiled_by_inductor_still_refuses_an_index_out_of_range(server: NodeProcess) -> None:
    """embedding_bag's index check (genie.server.validators) reads the indices, a graph input: it runs on them
    before the compiled code, on every replay, so an index out of range is refused naming the node, as node by
    node (and never reaches the generated kernel)."""
    from genie.errors import RemoteExecutionError

    bag = nn.EmbeddingBag(16, 4, mode="sum").to(D0)
    weight = bag.weight.detach().cpu()
    run = torch.compile(lambda ids, offsets: bag(ids, offsets) * 2, backend="genie")
    ids, offsets = torch.tensor([1, 2, 3, 15, 0, 7]), torch.tensor([0, 3])
    expected = torch.stack([weight[ids[:3]].sum(0), weight[ids[3:]].sum(0)]) * 2
    before = _compiled(server)
    with torch.no_grad():
        for _ in range(2):  # checked, then admitted: the compile is queued
            torch.testing.assert_close(run(ids.to(D0), offsets.to(D0)).cpu(), expected)
        wait_until(lambda: _compiled(server) - before, timeout=240, what="the node to compile the embedding graph")
        torch.testing.assert_close(run(ids.to(D0), offsets.to(D0)).cpu(), expected)  # compiled
        with pytest.raises(RemoteExecutionError, match=r"node \d+ \(aten::_?embedding_bag.*indices") as refused:
            run(torch.tensor([1, 2, 3, 16, 0, 7]).to(D0), offsets.to(D0)).cpu()
        assert "compiled by inductor" not in str(refused.value)  # the check's refusal, not the kernel's
        torch.testing.assert_close(run(ids.to(D0), offsets.to(D0)).cpu(), expected)


@pytest.mark.slow
def test_a_compile_that_fails_leaves_the_graph_node_by_node_logged_once(tmp_path: Path) -> None:
    """A node whose C++ compiler does not work (CXX=/bin/false: inductor's CPU code cannot be built): the
    graph's compile fails once, is logged once, and every replay, before and after, runs node by node,
    correctly. The client replays until the test has seen the node's log line."""
    stop = tmp_path / "stop"
    body = f"""
    import os, time
    x = torch.arange(12.0).reshape(3, 4)
    f = torch.compile(lambda t: (t * 2 + 1).relu().sum(0), backend="genie")
    deadline = time.monotonic() + 240
    n = 0
    while not os.path.exists({str(stop)!r}) and time.monotonic() < deadline:
        assert torch.equal(f(x.to("remote_accelerator:0")).cpu(), (x * 2 + 1).relu().sum(0))
        n += 1
        time.sleep(0.1)  # not a wait: paces the replays while the node compiles
    for _ in range(3):
        assert torch.equal(f(x.to("remote_accelerator:0")).cpu(), (x * 2 + 1).relu().sum(0))
    print("OK", n)
    """
    with _serve(env={"CXX": "/bin/false"}) as node:
        done: list[Any] = []
        client = threading.Thread(target=lambda: done.append(run_client(node.control_port, body, timeout=300)))
        client.start()
        try:
            failed = wait_until(lambda: _lines(node, "inductor could not compile it"), timeout=240,
                                what="the node to log the failed compile")
        finally:
            stop.touch()
            client.join(60)
        assert done and done[0].returncode == 0 and "OK" in done[0].stdout, done and done[0].stderr[-3000:]
        assert len(_lines(node, "inductor could not compile it")) == 1 and "it runs node by node" in failed[0]
        assert not _compiled(node)
        # one "queued" line per compile, before its outcome: benchmarks/bench_graph.py waits for every queued
        # compile by counting them (timing while one runs measured the compile's hold on the GIL, not the replays)
        queued = _lines(node, "queued for inductor")
        assert len(queued) == 1 and node.log().index(queued[0]) < node.log().index(failed[0]), queued
