"""GRAPH/REPLAY goes through the op path's gate: every node of a replayed graph gets the pre-flight a single op
gets (quota before allocation, the element cap, validators and index checks, argument refusals, the split limit),
on its actual inputs, and the op deadline covers the whole replay (genie/server/graphs.py).

Against a real node process (64 MiB session quota, a short op deadline) with a bystander session doing real work
beside the attack: each attack of issue 28 sent as a graph node gets the refusal the op path gives (or ends its
own session at the deadline), the bystander's data and work are unharmed, and the attacker's session worker never
grows by more than twice the quota.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from genie.errors import QuotaExceededError, RemoteExecutionError
from genie.server.store import StorageStore
from genie.testing import serve_subprocess, wait_until
from genie.wire.graph import Ref, encode_definition
from genie.wire.messages import CMD_GRAPH, CMD_REPLAY
from tests.raw_client import Dev, RawClient, T, desc, encode_value, free, op, pack, resize, sync
from tests.security import fuzz_ops

QUOTA = 64 << 20
DEADLINE = 3.0
_F32 = desc(1, torch.ones(1))[1]
_BYSTANDER = torch.arange(256, dtype=torch.float32)
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    """One node process (one CPU device, a 64 MiB session quota, a 3 s op deadline) for this module."""
    env = {"GENIE_MAX_SESSION_BYTES": str(QUOTA), "GENIE_OP_DEADLINE": str(DEADLINE)}
    with serve_subprocess("--port", "0", "--devices", "cpu", log_level="WARNING", env=env) as s:
        yield s


class Bystander:
    """Another session of the node doing real work: it keeps a tensor and computes with it."""

    def __init__(self, port: int) -> None:
        self.client = RawClient(port, timeout=60)  # a loaded machine (CI's two cores) must not fail it
        self.client.handshake()
        self.client.request([sync(self.client.next_req())], [(1, 0, _BYSTANDER)])
        self.outputs = itertools.count(1000)

    def work(self) -> None:
        """One op on its tensor, fetched and compared with the CPU's answer; the tensor itself unchanged."""
        c, out = self.client, next(self.outputs)
        expected = _BYSTANDER * 2 + 1
        r = c.request([op("aten::add.Tensor", [T(1, _BYSTANDER), T(1, _BYSTANDER)], {"alpha": 1}, [desc(out, expected)]),
                       op("aten::add_.Scalar", [T(out, expected), 1], {}, [desc(out, expected)]),
                       sync(c.next_req())])
        assert not r.deferred, r
        got = c.fetch(out, expected)
        c.request([free(out), sync(c.next_req())])
        assert torch.equal(got, expected), got[:8]
        assert torch.equal(c.fetch(1, _BYSTANDER), _BYSTANDER)


@pytest.fixture(scope="module")
def bystander(server: Any) -> Iterator[Bystander]:
    b = Bystander(server.port)
    b.work()  # its worker's first op loads what ops need: not part of any attack's figures
    yield b
    b.client.close()


@pytest.fixture
def client(server: Any, bystander: Bystander) -> Iterator[RawClient]:
    """The attacker's session, warmed: a fresh worker's first pre-flight loads torch's meta kernels (tens of MiB,
    a second or more), which is no part of what an attack costs."""
    c = RawClient(server.port, timeout=60)
    c.handshake()
    assert op_error(c, "aten::ones", [[2**28]], {"dtype": torch.float32, "device": Dev(0)}) is not None
    assert run_graph(c, [["aten::ones", [[4]], {"dtype": torch.float32, "device": Dev(0)}],
                         ["aten::sum", [Ref(0)], {}]], outputs=[Ref(1)], outs=[desc(1, torch.ones(()))]) is None
    yield c
    c.close()
    assert server.alive(), server.log()[-3000:]
    bystander.work()


# -- sending graphs on the raw wire ---------------------------------------------------------------


def graph(req: int, graph_id: int, inputs: int, nodes: list[list[Any]], outputs: list[Any]) -> bytes:
    """``[CMD_GRAPH, req, 0, graph_id, definition]``."""
    return pack([CMD_GRAPH, req, 0, graph_id, encode_definition(inputs, nodes, outputs, encode_value)])


def replay(graph_id: int, inputs: list[Any], outs: list[Any]) -> bytes:
    """``[CMD_REPLAY, 0, graph_id, inputs, outs]``."""
    return pack([CMD_REPLAY, 0, graph_id, inputs, outs])


def as_node(args: Any, inputs: list[Any]) -> Any:
    """``args`` with every tensor argument (a raw client T) made a graph input (a reference to its slot)."""
    return fuzz_ops.graph_inputs(args, inputs, lambda value: isinstance(value, T))


def run_graph(c: RawClient, nodes: list[list[Any]], inputs: Sequence[Any] = (), outputs: Sequence[Any] = (),
              outs: Sequence[Any] = (), uploads: Sequence[Any] = ()) -> dict[str, Any] | None:
    """Define a graph and replay it once: the first error (the definition's, else the replay's), or None."""
    graph_id = next(_ids)
    r = c.request([graph(c.next_req(), graph_id, len(inputs), nodes, list(outputs))], uploads)
    if r.error is not None:
        return r.error
    assert not r.deferred, r
    r = c.request([replay(graph_id, list(inputs), list(outs)), sync(c.next_req())])
    assert len(r.deferred) <= 1, r
    return r.deferred[0] if r.deferred else None


def op_error(c: RawClient, name: str, args: list[Any], kwargs: dict[str, Any], uploads: Sequence[Any] = (),
             returns: int = 1) -> dict[str, Any] | None:
    r = c.request([op(name, args, kwargs, outs=[None] * returns), sync(c.next_req())], uploads)
    assert len(r.deferred) <= 1, r
    return r.deferred[0] if r.deferred else None


def node_error(c: RawClient, name: str, args: list[Any], kwargs: dict[str, Any],
               uploads: Sequence[Any] = ()) -> dict[str, Any] | None:
    """The op as the one node of a graph, its tensor arguments the graph's inputs."""
    inputs: list[Any] = []
    node = [name, as_node(args, inputs), as_node(kwargs, inputs)]
    return run_graph(c, [node], inputs, uploads=uploads)


def _same_refusal(on_op_path: dict[str, Any] | None, as_node_: dict[str, Any] | None) -> None:
    assert on_op_path is not None and as_node_ is not None, (on_op_path, as_node_)
    assert as_node_["kind"] == on_op_path["kind"], (on_op_path, as_node_)
    assert on_op_path["message"] in as_node_["message"], (on_op_path, as_node_)


# -- the session worker's memory -------------------------------------------------------------------


def _worker_of(server: Any, c: RawClient) -> psutil.Process:
    """The session worker process serving ``c`` (the node's descendant holding the other end of its socket)."""
    port = c.channel._sock.getsockname()[1]  # type: ignore[attr-defined]  # noqa: SLF001 - the test's own socket
    node = psutil.Process(server.process.pid)

    def find() -> psutil.Process | None:
        for proc in node.children(recursive=True):
            try:
                if any(conn.raddr and conn.raddr.port == port for conn in proc.net_connections("tcp")):
                    return proc
            except psutil.Error:
                continue
        return None

    return wait_until(find, 10, 0.05, what="a session worker holding the test's socket")


def _peak(proc: psutil.Process) -> int:
    """The process's peak resident memory (VmHWM), bytes."""
    status = Path(f"/proc/{proc.pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


class Measured:
    """The attacker's worker's peak memory growth and the time to the answer, printed for the report."""

    def __init__(self, server: Any, c: RawClient, what: str) -> None:
        self.worker = _worker_of(server, c)
        self.what = what
        self.before = _peak(self.worker)
        self.started = time.monotonic()

    def done(self) -> tuple[int, float]:
        seconds = time.monotonic() - self.started
        grown = _peak(self.worker) - self.before
        print(f"{self.what}: worker peak +{grown / 2**20:.1f} MiB, answered in {seconds * 1000:.1f} ms")
        return grown, seconds


# -- the attacks of issue 28 ----------------------------------------------------------------------


def test_a_transient_allocation_over_the_quota_is_refused_before_it_is_made(server, client):
    """``ones([2**28]) -> sum`` (1 GiB of transient memory under a 64 MiB quota) was answered ok after taking
    +1,097 MiB; now the ``ones`` node is refused as on the op path, before a byte is allocated."""
    c = client
    client.request([sync(c.next_req())])
    m = Measured(server, c, "graph ones([2**28]) -> sum")
    error = run_graph(c, [["aten::ones", [[2**28]], {"dtype": torch.float32, "device": Dev(0)}],
                          ["aten::sum", [Ref(0)], {}]], outputs=[Ref(1)], outs=[desc(2, torch.ones(()))])
    grown, _ = m.done()
    on_op_path = op_error(c, "aten::ones", [[2**28]], {"dtype": torch.float32, "device": Dev(0)})
    _same_refusal(on_op_path, error)
    assert error["kind"] == "quota" and "graph" in error["op"] and "node 0 (aten::ones)" in error["op"], error
    assert grown < 2 * QUOTA
    # The refused replay's output holds the cause.
    r = c.request([op("aten::add.Tensor", [T(2, torch.ones(())), 1], {}, [desc(3, torch.ones(()))]), sync(c.next_req())])
    assert r.deferred and "1073741824 bytes" in r.deferred[0]["message"], r


def test_a_resize_in_a_graph_is_refused_before_it_grows_the_storage(server, client):
    """``resize_(input, [2**28])`` as a node kept +1,069 MiB with no error; now refused by the pre-flight, and the
    input keeps its size and bytes."""
    c, x = client, torch.arange(3, dtype=torch.float32)
    c.request([sync(c.next_req())], [(5, 0, x)])
    m = Measured(server, c, "graph resize_(input, [2**28])")
    error = node_error(c, "aten::resize_", [T(5, x), [2**28]], {})
    grown, _ = m.done()
    _same_refusal(op_error(c, "aten::resize_", [T(5, x), [2**28]], {}), error)
    assert error["kind"] == "quota", error
    assert grown < 2 * QUOTA
    assert torch.equal(c.fetch(5, x), x)


def test_the_quota_counts_the_intermediates_a_view_keeps_alive(server, client):
    """Four 20 MiB intermediates, each kept alive by a view of it until the end (80 MiB at once): refused at the
    fourth, though each node alone fits and each base's own slot is dropped early."""
    c, n = client, 5 << 20
    nodes: list[list[Any]] = []
    views = []
    for _ in range(4):
        nodes.append(["aten::ones", [[n]], {"dtype": torch.float32, "device": Dev(0)}])
        nodes.append(["aten::view", [Ref(len(nodes) - 1), [n]], {}])
        views.append(Ref(len(nodes) - 1))
    for v in views:
        nodes.append(["aten::sum", [v], {}])
    error = run_graph(c, nodes, outputs=[Ref(len(nodes) - 1)], outs=[desc(2, torch.ones(()))])
    assert error is not None and error["kind"] == "quota" and "node 6 (aten::ones)" in error["op"], error


def test_intermediates_freed_on_the_way_do_not_count_against_the_quota(server, client):
    """A chain of 40 adds over a 4 MiB tensor (160 MiB made, 8 MiB at most alive at once) runs under a 64 MiB
    quota, replay after replay, and computes what the CPU computes."""
    c, x = client, torch.zeros(1 << 20)
    nodes = [["aten::add.Tensor", [Ref(i), 1.0], {}] for i in range(40)]
    graph_id = next(_ids)
    r = c.request([graph(c.next_req(), graph_id, 1, nodes, [Ref(40)])], [(5, 0, x)])
    assert r.error is None, r
    for i in range(3):
        r = c.request([replay(graph_id, [T(5, x)], [desc(10 + i, x)]), sync(c.next_req())])
        assert not r.deferred, r
        assert torch.equal(c.fetch(10 + i, x), torch.full_like(x, 40.0))


_PLANE = torch.zeros(1, 1, 2, 2)
_G1 = torch.ones(1, 1, 1, 1)


@pytest.mark.parametrize(("name", "args", "uploads", "expect"), [
    # offset2bag = 1..4096 indexes grad's rows unchecked: as a node it returned heap words
    ("aten::_embedding_bag_per_sample_weights_backward",
     [T(5, torch.ones(2, 3)), T(6, torch.ones(4, 3)), T(7, torch.tensor([0, 1, 2])), T(8, torch.tensor([0])),
      T(9, torch.arange(1, 4097)), 0],
     [(5, 0, torch.ones(2, 3)), (6, 0, torch.ones(4, 3)), (7, 0, torch.tensor([0, 1, 2])), (8, 0, torch.tensor([0])),
      (9, 0, torch.arange(1, 4097))], "offset2bag"),
    # indices 10**11 into a 4-element plane: as a node the worker died (SIGSEGV)
    ("aten::max_pool2d_with_indices_backward",
     [T(2, _G1), T(3, _PLANE), [2, 2], [2, 2], [0, 0], [1, 1], False, T(4, torch.tensor([[[[10**11]]]]))],
     [(2, 0, _G1), (3, 0, _PLANE), (4, 0, torch.tensor([[[[10**11]]]]))], "indices holds values outside [-1, 4)"),
    # a stride-0 view of one element as 2**40: the reduction ran for minutes
    ("aten::sum", [T([3, _F32, [2**40], [0], 0, 4])], [(3, 0, torch.ones(1))], "max_op_elements"),
])
def test_nodes_that_index_by_client_data_or_iterate_too_far_get_the_op_paths_refusal(server, client, name, args,
                                                                                    uploads, expect):
    c = client
    m = Measured(server, c, f"graph node {name}")
    error = node_error(c, name, args, {}, uploads)
    m.done()
    _same_refusal(op_error(c, name, args, {}), error)
    assert expect in error["message"], error


def test_a_huge_expand_made_inside_the_graph_is_refused_at_the_reduction(server, client):
    """``sum(expand(ones(1), [2**40]))`` with every tensor made by the graph itself: still used a core 31 s after
    it started; now refused by the element cap before the reduction runs, at the ``expand`` node (a view of
    2**40 elements, which the op path refuses too)."""
    c = client
    started = time.monotonic()
    error = run_graph(c, [["aten::ones", [[1]], {"dtype": torch.float32, "device": Dev(0)}],
                          ["aten::expand", [Ref(0), [2**40]], {}],
                          ["aten::sum", [Ref(1)], {}]], outputs=[Ref(2)], outs=[desc(2, torch.ones(()))])
    print(f"graph sum(expand(ones(1), [2**40])): refused in {(time.monotonic() - started) * 1000:.1f} ms")
    assert error is not None and error["kind"] == "forbidden" and "max_op_elements" in error["message"], error
    assert "node 1 (aten::expand)" in error["op"], error
    huge = T([3, _F32, [2**40], [0], 0, 4])
    _same_refusal(op_error(c, "aten::expand", [T(3, torch.ones(1)), [2**40]], {}, [(3, 0, torch.ones(1))]),
                  node_error(c, "aten::expand", [T(3, torch.ones(1)), [2**40]], {}))
    _same_refusal(op_error(c, "aten::sum", [huge], {}), node_error(c, "aten::sum", [huge], {}))


@pytest.mark.parametrize(("name", "args", "kwargs", "expect"), [
    ("aten::arange", [16], {"pin_memory": True, "device": Dev(0)}, "pin_memory=True"),
    ("aten::scalar_tensor", [0], {"dtype": 2**40}, "must be a dtype"),
    ("aten::empty.memory_format", [[2, 3]], {"layout": torch.sparse_coo, "device": Dev(0)}, "layout"),
])
def test_argument_refusals_come_at_definition_time(client, name, args, kwargs, expect):
    """pin_memory=True, a dtype as the raw int 2**40 and a sparse layout were defined and replayed; now the
    GRAPH command itself is refused, naming the node and the op path's reason."""
    c = client
    graph_id = next(_ids)
    r = c.request([graph(c.next_req(), graph_id, 0, [[name, args, kwargs]], [Ref(0)])])
    assert r.error is not None and expect in r.error["message"] and "node 0" in r.error["message"], r
    _same_refusal(op_error(c, name, args, kwargs), {**r.error, "kind": r.error["kind"]})
    r = c.request([replay(graph_id, [], [None]), sync(c.next_req())])
    assert r.deferred and "not defined" in r.deferred[0]["message"], r


def test_a_split_into_too_many_views_is_refused(client):
    """A split into 2**20 views: refused at definition time when its count is a constant, at replay when it
    comes from the input's shape."""
    c, x = client, torch.ones(3)
    r = c.request([graph(c.next_req(), next(_ids), 1, [["aten::tensor_split.sections", [Ref(0), 2**20], {}]],
                         [Ref(0, 0)])])
    assert r.error is not None and "it would return 1048576 tensors" in r.error["message"], r
    wide = T([3, _F32, [2**20], [0], 0, 4])
    error = node_error(c, "aten::unbind.int", [wide], {}, [(3, 0, x)])
    _same_refusal(op_error(c, "aten::unbind.int", [wide], {}), error)


def test_a_replay_that_runs_past_the_deadline_ends_its_session_alone(server, client, bystander):
    """``special_laguerre_polynomial_l.n_scalar`` with n = 2**31-1, which the op path kills at the deadline, ran
    past 30 s as a node (the op clock never started during a replay): now the node kills the session's worker at
    the deadline, naming the graph; the bystander works throughout."""
    c, x = client, torch.full((1,), 0.5)
    graph_id = next(_ids)
    r = c.request([graph(c.next_req(), graph_id, 1,
                         [["aten::special_laguerre_polynomial_l.n_scalar", [Ref(0), 2**31 - 1], {}]], [Ref(1)])],
                  [(5, 0, x)])
    assert r.error is None, r
    done = threading.Event()
    worked: list[float] = []
    failures: list[BaseException] = []
    slowest = [0.0]

    def busy() -> None:
        while not done.is_set():
            try:
                began = time.monotonic()
                bystander.work()
                worked.append(time.monotonic())
                slowest[0] = max(slowest[0], worked[-1] - began)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)
                return

    thread = threading.Thread(target=busy)
    thread.start()
    started = time.monotonic()
    try:
        c.send_batch([replay(graph_id, [T(5, x)], [desc(6, x)]), sync(c.next_req())])
        try:
            kind, body, _ = c.recv()
        except (OSError, ConnectionError) as exc:
            kind, body = None, str(exc)
        lost = time.monotonic() - started
    finally:
        done.set()
        thread.join(30)
    print(f"graph laguerre n=2**31-1: session ended after {lost:.2f} s ({body!r:.160}); the bystander's work: "
          f"{len(worked)} rounds meanwhile, the slowest {slowest[0] * 1000:.0f} ms")
    assert not failures, failures
    assert "deadline of 3 s exceeded by graph" in str(body), (kind, body)
    assert DEADLINE <= lost < DEADLINE + 25, lost  # a few seconds; generous for a loaded machine
    assert any(started < t < started + lost for t in worked), worked


def test_the_store_refuses_growth_in_place_past_the_quota():
    """StorageStore.resized, which every path that grows a storage in place reports to, enforces the byte quota
    itself: growth within it is counted, growth past it poisons the storage (the session lets go of it and its
    memory) and raises."""
    store = StorageStore(max_bytes=1024)
    storage = torch.zeros(16, dtype=torch.uint8).untyped_storage()
    store.put(1, storage)
    storage.resize_(512)
    store.resized(1)
    assert store.bytes_used == 512
    storage.resize_(4096)
    with pytest.raises(QuotaExceededError, match=r"grew in place by 3584 bytes .*max_session_bytes"):
        store.resized(1)
    assert store.bytes_used == 0 and 1 not in store
    with pytest.raises(RemoteExecutionError, match="grew in place"):
        store.get(1)


# -- legitimate graphs -------------------------------------------------------------------------


def test_a_steady_replay_loop_runs_the_full_check_once_per_signature(genie_inproc_server):
    """The pre-flight of every node runs on a signature's first replay; later replays with that signature pay
    only the quota figure and the validators that read data (an in-process node, to read its books)."""
    from genie.server import graphs

    node = genie_inproc_server(1, isolation="none", max_session_bytes=QUOTA)
    c = RawClient(node.port)
    c.handshake()
    try:
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        nodes = [["aten::mm", [Ref(0), Ref(1)], {}], ["aten::relu", [Ref(2)], {}], ["aten::sum", [Ref(3)], {}]]
        graph_id = next(_ids)
        r = c.request([graph(c.next_req(), graph_id, 2, nodes, [Ref(4)])], [(1, 0, x), (2, 0, x.t().contiguous())])
        assert r.error is None, r
        for i in range(10):
            r = c.request([replay(graph_id, [T(1, x), T(2, x.t().contiguous())], [desc(10 + i, torch.ones(()))]),
                           sync(c.next_req())])
            assert not r.deferred, r
        assert c.fetch(19, torch.ones(())) == (x @ x.t()).relu().sum()
        y = torch.ones(4, 3)
        r = c.request([replay(graph_id, [T(3, y), T(2, x.t().contiguous())], [desc(30, torch.ones(()))]),
                       sync(c.next_req())], [(3, 0, y)])
        assert not r.deferred, r
        assert _books(graphs, graph_id) == (2, 11)
    finally:
        c.close()


def _books(graphs: Any, graph_id: int) -> tuple[int, int]:
    """(checked replays, replays) of graph ``graph_id`` in the in-process node's books."""
    found = next(g.graphs[graph_id] for g in graphs._sessions.values() if graph_id in g.graphs)  # noqa: SLF001
    return found.checked_runs, found.replays


def test_signatures_whose_nodes_depend_on_data_are_checked_in_full_every_time(genie_inproc_server):
    """A node whose output size depends on the data (``nonzero``) or that returns a number makes no gate: each
    replay is checked node by node, and such a node's intermediates are measured after it ran, so two 32 MiB
    ``nonzero`` results alive at once under a 64 MiB quota are refused at the second."""
    from genie.server import graphs

    node = genie_inproc_server(1, isolation="none", max_session_bytes=QUOTA)
    c = RawClient(node.port)
    c.handshake()
    try:
        few = torch.tensor([True, False, True])
        sized, counted = next(_ids), next(_ids)
        r = c.request([graph(c.next_req(), sized, 1, [["aten::nonzero", [Ref(0)], {}]], [Ref(1)])], [(1, 0, few)])
        assert r.error is None, r
        r = c.request([graph(c.next_req(), counted, 1, [["aten::numel", [Ref(0)], {}],
                                                        ["aten::logical_not", [Ref(0)], {}]], [Ref(2)])])
        assert r.error is None, r
        for i in range(3):
            r = c.request([replay(sized, [T(1, few)], [desc(10 + i, torch.zeros(2, 1, dtype=torch.int64))]),
                           replay(counted, [T(1, few)], [desc(20 + i, few)]), sync(c.next_req())])
            assert not r.deferred, r
        assert _books(graphs, sized) == (3, 3) and _books(graphs, counted) == (3, 3)
        assert torch.equal(c.fetch(22, few), ~few)
        many = torch.ones(1 << 22, dtype=torch.bool)
        twice = next(_ids)
        r = c.request([graph(c.next_req(), twice, 1, [["aten::nonzero", [Ref(0)], {}], ["aten::nonzero", [Ref(0)], {}],
                                                      ["aten::add.Tensor", [Ref(1), Ref(2)], {}],
                                                      ["aten::sum", [Ref(3)], {}]], [Ref(4)])], [(2, 0, many)])
        assert r.error is None, r
        r = c.request([replay(twice, [T(2, many)], [desc(30, torch.zeros((), dtype=torch.int64))]), sync(c.next_req())])
        assert len(r.deferred) == 1 and r.deferred[0]["kind"] == "quota", r
        assert "node 1 (aten::nonzero)" in r.deferred[0]["op"] and "intermediates alive" in r.deferred[0]["message"]
    finally:
        c.close()


def test_a_cached_signature_still_checks_the_data_of_every_replay(server, client):
    """The validators and index checks read data, so they run on every replay, cached signature or not: indices
    that passed twice and then hold 10**11 (same shape) are refused with the op path's message."""
    c, grad, plane = client, torch.ones(1, 1, 1, 1), torch.zeros(1, 1, 2, 2)
    good, bad = torch.tensor([[[[3]]]]), torch.tensor([[[[10**11]]]])
    graph_id = next(_ids)
    r = c.request([graph(c.next_req(), graph_id, 3, [["aten::max_pool2d_with_indices_backward",
                                                      [Ref(0), Ref(1), [2, 2], [2, 2], [0, 0], [1, 1], False, Ref(2)],
                                                      {}]], [Ref(3)])],
                  [(2, 0, grad), (3, 0, plane), (4, 0, good), (5, 0, bad)])
    assert r.error is None, r
    for i in range(2):
        r = c.request([replay(graph_id, [T(2, grad), T(3, plane), T(4, good)], [desc(10 + i, plane)]),
                       sync(c.next_req())])
        assert not r.deferred, r
    assert torch.equal(c.fetch(11, plane), torch.tensor([[[[0.0, 0.0], [0.0, 1.0]]]]))
    r = c.request([replay(graph_id, [T(2, grad), T(3, plane), T(5, bad)], [desc(12, plane)]), sync(c.next_req())])
    assert len(r.deferred) == 1 and "indices holds values outside [-1, 4)" in r.deferred[0]["message"], r


# -- the fuzzer's refused cases, as graph nodes ----------------------------------------------------

#: Draws from the op fuzzer (tests/security/fuzz_ops.py) per run of the test: seeded, so always the same cases.
FUZZ_SEED = 20261128
FUZZ_DRAWS = 160


def _writes(schema: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def test_every_call_the_fuzzer_gets_refused_on_the_op_path_is_refused_alike_as_a_graph_node(server, bystander):
    """Seeded draws from the op fuzzer's generator, each sent on the op path in one session and as the one node of a
    graph in another (both holding the fuzzer's tensors): every call the op path refuses gets the same error kind
    and message as a node. Calls that write and ran are sent to both sessions, so their storages stay alike; after
    one that writes and failed, both sessions' tensors are restored."""
    rng = random.Random(FUZZ_SEED)
    ops = fuzz_ops.fuzzable_ops()
    base = [(sid, 0, t) for sid, t in fuzz_ops._BASE.items()]  # noqa: SLF001 - the fuzzer's own tensors

    def session() -> RawClient:
        c = RawClient(server.port, timeout=DEADLINE + 20)
        c.handshake()
        c.request([sync(c.next_req())], base)
        return c

    scratch = itertools.count(1 << 20)

    def restore(c: RawClient) -> bool:
        """The fuzzer's tensors back as they were (sizes and bytes), in one batch; False if that failed."""
        cmds, uploads = [], []
        for sid, t in fuzz_ops._BASE.items():  # noqa: SLF001
            copy = next(scratch)
            uploads.append((copy, 0, t))
            cmds += [resize(0, sid, t.untyped_storage().nbytes()),
                     op("aten::copy_", [T(sid, t), T(copy, t)], {}, [desc(sid, t)]), free(copy)]
        return not c.request([*cmds, sync(c.next_req())], uploads).deferred

    on_ops, on_graphs = session(), session()
    compared = 0
    try:
        for _ in range(FUZZ_DRAWS):
            name, schema = rng.choice(ops)
            cmd = fuzz_ops._call(rng, name, schema)  # noqa: SLF001 - the fuzzer's own draw
            try:
                r = on_ops.request([cmd, sync(on_ops.next_req())])
            except (OSError, ConnectionError, AssertionError):
                on_ops.close()  # a kill at the deadline: both start afresh
                on_graphs.close()
                on_ops, on_graphs = session(), session()
                continue
            if not r.deferred or r.deferred[0]["kind"] == "mismatch":  # ran (the output rule is the client's part)
                if _writes(schema):
                    on_graphs.request([cmd, sync(on_graphs.next_req())])
                continue
            expected = r.deferred[0]
            define, run_it = fuzz_ops.as_graph(cmd, name, on_graphs.next_req(), next(_ids))
            r = on_graphs.request([define])
            got = r.error
            if got is None:
                r = on_graphs.request([run_it, sync(on_graphs.next_req())])
                got = r.deferred[0] if r.deferred else None
            if expected["kind"] in ("storage", "protocol"):
                # The command's own framing (a descriptor past its storage, a device the node lacks): a graph
                # checks its definition before its inputs, so another of these may come first. Refused all the same.
                assert got is not None, (expected, name)
            else:
                _same_refusal(expected, got)
                compared += 1
            if _writes(schema) and not (restore(on_ops) and restore(on_graphs)):  # it may have written, then failed
                on_ops.close()
                on_graphs.close()
                on_ops, on_graphs = session(), session()
    finally:
        on_ops.close()
        on_graphs.close()
    print(f"fuzzer's refused calls compared as graph nodes: {compared} of {FUZZ_DRAWS}")
    assert compared >= FUZZ_DRAWS // 3
