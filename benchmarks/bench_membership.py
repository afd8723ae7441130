"""One master, 1,000 simulated nodes joining and heartbeating while 50 clients are connected: how soon every
client sees every node, master CPU, ack latency, false losses, placement time (issues 3 and 13).

    .venv/bin/python benchmarks/bench_membership.py                  # about 1.5 minutes
    .venv/bin/python benchmarks/bench_membership.py --nodes 200 --seconds 20

A real ``genie serve --devices cpu --heartbeat-interval 1 --heartbeat-timeout 5``
is the master. This process simulates the nodes on one anyio loop: each opens a
control connection, sends JOIN (a worker ``NodeInfo`` with a fake data port and one
``cpu`` device), then behaves like genie's runtime heartbeat loop: HEARTBEAT
``{"node_id", "metrics"}``, wait for the HEARTBEAT_ACK (at most heartbeat_timeout;
on a timeout it reconnects and joins again, as the runtime does), sleep the interval.
Nothing here is simulated on the master's side.

``--clients`` (50) simulated clients JOIN before the nodes do and then behave like a
client runtime: HEARTBEAT with ``known`` = the membership version they applied, and
record when each node first appears in an ack (the master sends only the nodes changed
since ``known``). A node's visibility delay at a client is that moment minus the moment
its JOINED reply arrived; the target is 2 heartbeat intervals for every (client, node).

Figures, over a steady window of ``--seconds`` after every node has joined:

- master CPU: ``psutil`` cpu_times delta of the master process / wall, % of one core;
- heartbeat round trip (send -> ack) p50/p99/max, against the same figure with a
  single node measured first, heartbeating back to back (the baseline);
- false NODE_LOST events: a SUBSCRIBE connection counts EVENT messages of type
  ``node_lost`` about simulated nodes (none is ever really lost), and a final QUERY
  counts simulated nodes the master does not hold as connected;
- heartbeats acknowledged per second (the offered load is nodes / interval);
- for diagnosis, the master's per-ack work measured in this process: ``Membership.snapshot()``
  and ``ControlService._ack()`` with the same number of members;
- placement decision time: :func:`genie.cluster.placement.candidates` + ``choose`` over the
  final QUERY reply (every node's reported figures) with a device table of every node.

The simulator's own CPU is printed too: if it nears 100 % of a core, its own delays
inflate the latencies. Asserts nothing; stops the master on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402
import anyio  # noqa: E402

from genie.errors import GenieError  # noqa: E402
from genie.security import ClientSecurity  # noqa: E402
from genie.wire import control  # noqa: E402
from genie.wire.frame import MsgKind  # noqa: E402
from genie.wire.handshake import connect_control  # noqa: E402


def node_info(i: int) -> dict[str, Any]:
    return {
        "node_id": f"sim-{i:05d}", "hostname": "sim", "role": "worker", "address": "127.0.0.1",
        "data_port": 20000 + i % 40000, "gpus": [{"index": 0, "name": "cpu0", "kind": "cpu"}],
        "backends": ["tcp"], "status": "connected",
    }


class Sim:
    """Shared counters of the simulated nodes."""

    def __init__(self, port: int, interval: float, timeout: float) -> None:
        self.port = port
        self.interval = interval
        self.timeout = timeout
        self.measuring = False
        self.back_to_back = False  #: the single-node baseline: heartbeats without the interval's sleep
        self.latencies: list[float] = []
        self.join_latencies: list[float] = []
        self.joined = 0
        self.acks_in_window = 0
        self.ack_timeouts = 0
        self.rejoins = 0
        self.errors: list[str] = []
        self.events: dict[str, int] = {}
        self.lost_ids: set[str] = set()
        self.subscribed = anyio.Event()
        self.joined_at: dict[str, float] = {}  #: node id -> when its JOINED arrived
        self.seen_at: list[dict[str, float]] = []  #: per client: node id -> when an ack first listed it
        self.clients_ready = 0

    async def subscriber(self) -> None:
        stream = await connect(self.port)
        async with stream:
            await control.send_msg(stream, MsgKind.SUBSCRIBE, {})
            self.subscribed.set()
            while True:
                kind, body = await control.recv_msg(stream)
                if kind != MsgKind.EVENT:
                    continue
                etype = str(body.get("type"))
                self.events[etype] = self.events.get(etype, 0) + 1
                if etype == "node_lost" and str(body.get("source", "")).startswith("sim-"):
                    self.lost_ids.add(str(body["source"]))

    async def join(self, i: int) -> Any:
        stream = await connect(self.port)
        t0 = time.perf_counter()
        await control.request(stream, MsgKind.JOIN, {"node": node_info(i)}, MsgKind.JOINED)
        now = time.perf_counter()
        self.join_latencies.append(now - t0)
        self.joined_at.setdefault(node_info(i)["node_id"], now)
        return stream

    async def client(self, c: int) -> None:
        """A client's heartbeat loop as genie's runtime runs it: ``known`` = the version it applied."""
        seen: dict[str, float] = {}
        self.seen_at.append(seen)
        node_id = f"client-{c:03d}"
        stream = await connect(self.port)
        info = {"node_id": node_id, "hostname": "sim", "role": "client", "address": "", "data_port": 0,
                "gpus": [], "backends": ["tcp"], "status": "connected"}
        async with stream:
            await control.request(stream, MsgKind.JOIN, {"node": info}, MsgKind.JOINED)
            self.clients_ready += 1
            known = -1
            while True:
                await control.send_msg(stream, MsgKind.HEARTBEAT, {"node_id": node_id, "metrics": {}, "known": known})
                kind, ack = await control.recv_msg(stream)
                now = time.perf_counter()
                if "nodes" in ack:
                    known = ack.get("version", -1)
                    for n in ack["nodes"]:
                        seen.setdefault(n["node_id"], now)
                await anyio.sleep(self.interval)

    async def node(self, i: int, join_limiter: anyio.CapacityLimiter, first_delay: float,
                   joined: anyio.Event | None = None) -> None:
        node_id = node_info(i)["node_id"]
        metrics = {"cpu_percent": 3.5, "memory_used": 1 << 30, "gpus": [{"index": 0, "utilization": 0.0}]}
        async with join_limiter:
            stream = await self.join(i)
        self.joined += 1
        if joined is not None:
            joined.set()
        await anyio.sleep(first_delay)
        backoff = 0.1
        while True:
            try:
                if stream is None:
                    async with join_limiter:
                        stream = await self.join(i)
                    self.rejoins += 1
                    backoff = 0.1
                t0 = time.perf_counter()
                await control.send_msg(stream, MsgKind.HEARTBEAT, {"node_id": node_id, "metrics": metrics})
                with anyio.fail_after(self.timeout):
                    kind, _ = await control.recv_msg(stream)
                rtt = time.perf_counter() - t0
                if kind != MsgKind.HEARTBEAT_ACK:
                    raise GenieError(f"expected HEARTBEAT_ACK, got {kind.name}")
                if self.measuring:
                    self.latencies.append(rtt)
                    self.acks_in_window += 1
                await anyio.sleep(0.005 if self.back_to_back else self.interval)
            except (GenieError, OSError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    self.ack_timeouts += 1
                elif len(self.errors) < 5:
                    self.errors.append(f"{node_id}: {type(exc).__name__}: {exc}")
                if stream is not None:
                    await stream.aclose()
                    stream = None
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)


async def connect(port: int) -> Any:
    """A control connection as genie's runtime opens one: the master answers nothing before HELLO."""
    return await connect_control("127.0.0.1", port, ClientSecurity(), role="worker")


async def query(port: int) -> dict[str, Any]:
    stream = await connect(port)
    async with stream:
        return await control.request(stream, MsgKind.QUERY, {}, MsgKind.QUERY_REPLY)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


async def simulate(args: argparse.Namespace, port: int, master: Any) -> dict[str, Any]:
    sim = Sim(port, args.interval, args.timeout)
    out: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(sim.subscriber)
        await sim.subscribed.wait()
        limiter = anyio.CapacityLimiter(args.join_concurrency)
        for k in range(args.clients):
            tg.start_soon(sim.client, k)
        while sim.clients_ready < args.clients:
            await anyio.sleep(0.05)

        # Baseline: one node alone.
        first = anyio.Event()
        tg.start_soon(sim.node, 0, limiter, 0.0, first)
        await first.wait()
        sim.back_to_back = sim.measuring = True
        await anyio.sleep(args.baseline_seconds)
        sim.back_to_back = sim.measuring = False
        out["single"] = list(sim.latencies)
        sim.latencies.clear()

        # The rest join, a few at a time, each starting its heartbeats at a random phase.
        t_join = time.perf_counter()
        for i in range(1, args.nodes):
            tg.start_soon(sim.node, i, limiter, random.uniform(0, args.interval))
        with anyio.move_on_after(args.join_deadline):
            while sim.joined < args.nodes:
                await anyio.sleep(0.05)
        out["join_s"] = time.perf_counter() - t_join
        out["joined"] = sim.joined
        await anyio.sleep(args.interval * 2)  # settle: every node has sent a heartbeat or two

        lost_before = len(sim.lost_ids)
        cpu0, wall0, self0 = master.cpu_times(), time.perf_counter(), time.process_time()
        sim.measuring = True
        await anyio.sleep(args.seconds)
        sim.measuring = False
        cpu1, wall1, self1 = master.cpu_times(), time.perf_counter(), time.process_time()
        wall = wall1 - wall0
        out["master_cpu"] = 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / wall
        out["sim_cpu"] = 100 * (self1 - self0) / wall
        out["window"] = wall
        out["latencies"] = list(sim.latencies)
        out["acks"] = sim.acks_in_window
        out["lost_events_total"] = len(sim.lost_ids)
        out["lost_events_window"] = len(sim.lost_ids) - lost_before
        out["events"] = dict(sim.events)
        out["ack_timeouts"] = sim.ack_timeouts
        out["rejoins"] = sim.rejoins
        out["errors"] = list(sim.errors)
        out["join_latencies"] = list(sim.join_latencies)
        t0 = time.perf_counter()
        snap: dict[str, Any] = {}
        with anyio.move_on_after(args.query_timeout):
            snap = await query(port)
        out["query_s"] = time.perf_counter() - t0
        sims = [n for n in snap.get("nodes", []) if str(n.get("node_id", "")).startswith("sim-")]
        out["query_ok"] = bool(snap)
        out["query_nodes"] = len(sims)
        out["query_not_connected"] = sum(1 for n in sims if n.get("status") != "connected")
        out["reply"] = snap
        delays = [seen[n] - t for seen in sim.seen_at for n, t in sim.joined_at.items() if n in seen]
        out["visibility"] = delays
        out["unseen"] = sum(1 for seen in sim.seen_at for n in sim.joined_at if n not in seen)
        tg.cancel_scope.cancel()
    return out


def placement_cost(reply: dict[str, Any]) -> tuple[float, float, int]:
    """Seconds per placement decision over ``reply``'s nodes (a device table of every device): with the
    reply read afresh (a new view, at most once per heartbeat interval) and from the read view; and how many."""
    from genie.cluster.nodes import _NoChannel
    from genie.cluster.placement import ClusterFigures, candidates, choose
    from genie.device.connection import NodeConnection
    from genie.device.registry import DeviceTable, RemoteDevice

    conns: dict[str, NodeConnection] = {}
    devices = []
    for d in reply.get("devices", []):
        conn = conns.setdefault(d["node_id"], NodeConnection(_NoChannel(), node_id=d["node_id"], address="sim"))
        devices.append(RemoteDevice(d["index"], d["node_id"], d["local_index"], d["kind"], d["name"], conn))
    table = DeviceTable(devices)
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        choose(candidates(table, ClusterFigures.from_reply(reply), {}))
    fresh = (time.perf_counter() - t0) / reps
    figures = ClusterFigures.from_reply(reply)
    t0 = time.perf_counter()
    for _ in range(reps):
        choose(candidates(table, figures, {}))
    return fresh, (time.perf_counter() - t0) / reps, len(devices)


def ack_cost(nodes: int) -> tuple[float, float, int]:
    """Seconds per Membership.snapshot() and per ControlService._ack() with ``nodes`` members, and the ack's bytes."""
    from genie.cluster.master import ControlService
    from genie.cluster.membership import Membership
    from genie.security import ServerSecurity
    from genie.types import NodeInfo
    from genie.wire.frame import pack_body

    m = Membership(5.0, self_id="master")
    for i in range(nodes):
        m.join(NodeInfo.from_dict(node_info(i)))
    svc = ControlService(m, heartbeat_interval=1.0, publish=lambda e: None, security=ServerSecurity())
    reps = max(3, 2000 // max(nodes, 1))
    t0 = time.perf_counter()
    for _ in range(reps):
        m.snapshot()
    snap = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        body = pack_body(svc._ack(None))  # what a worker's heartbeat gets: the version alone
    ack = (time.perf_counter() - t0) / reps
    return snap, ack, len(body)


def _node_output(node: Any) -> list[str]:
    try:
        return node.log().splitlines() if hasattr(node, "log") else list(getattr(node, "output", []))
    except OSError:
        return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=50, help="simulated clients connected while nodes join")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the measured steady window")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (master and nodes)")
    parser.add_argument("--timeout", type=float, default=5.0, help="heartbeat timeout (master and nodes)")
    parser.add_argument("--baseline-seconds", type=float, default=3.0, help="single-node baseline window")
    parser.add_argument("--join-concurrency", type=int, default=32, help="joins in flight at once")
    parser.add_argument("--join-deadline", type=float, default=40.0,
                        help="start the window after this many seconds even if not every node has joined")
    parser.add_argument("--query-timeout", type=float, default=30.0, help="give up on the final QUERY after this")
    parser.add_argument("--no-netns", action="store_true", help="run in place, not in a private network namespace")
    args = parser.parse_args()
    c.enter_private_netns()  # like the other benchmarks: nothing leaves the machine
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, min(hard, 4 * args.nodes + 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the master inherits it
    with c.sigterm_raises():
        return run(args)


def run(args: argparse.Namespace) -> int:
    import psutil

    from genie.cluster.launch import NodeProcess

    snap_s, ack_s, ack_bytes = ack_cost(args.nodes)
    print(f"bench_membership: {args.nodes} nodes, heartbeat every {args.interval:g} s, timeout {args.timeout:g} s, "
          f"window {args.seconds:g} s, {os.cpu_count()} CPUs, fd limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}")
    print(f"master work per heartbeat ack with {args.nodes} members (in-process): Membership.snapshot() "
          f"{snap_s * 1e3:.2f} ms, ControlService._ack() + msgpack {ack_s * 1e3:.2f} ms, ack {ack_bytes / 1024:.1f} KiB; "
          f"at {args.nodes / args.interval:.0f} heartbeats/s that is {100 * ack_s * args.nodes / args.interval:.0f} % "
          f"of one core")
    load = c.MachineLoad()
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", "--heartbeat-interval", str(args.interval),
                     "--heartbeat-timeout", str(args.timeout)) as server:
        c.quiet(server)
        port = server.control_port  # --port 0: any free port, bound
        master = psutil.Process(server.pid)
        res = anyio.run(simulate, args, port, master)
        master_alive = server.alive()
        output = _node_output(server)

    single = statistics.median(res["single"]) if res["single"] else float("nan")
    lat = res["latencies"]
    p50, p99 = pct(lat, 50), pct(lat, 99)
    offered = (args.nodes / args.interval)
    print(f"single node heartbeat round trip (baseline): p50 {single * 1e3:.2f} ms over {len(res['single'])} acks")
    print(f"joins: {res['joined']}/{args.nodes} in {res['join_s']:.1f} s; JOIN round trip p50 "
          f"{pct(res['join_latencies'], 50) * 1e3:.1f} ms, p99 {pct(res['join_latencies'], 99) * 1e3:.1f} ms")
    print(f"master CPU: {res['master_cpu']:.1f} % of one core over {res['window']:.1f} s "
          f"(simulator: {res['sim_cpu']:.1f} %)")
    print(f"heartbeat round trip with {args.nodes} nodes: p50 {p50 * 1e3:.2f} ms ({p50 / single:.1f}x single), "
          f"p99 {p99 * 1e3:.2f} ms, max {max(lat, default=float('nan')) * 1e3:.1f} ms; "
          f"{res['acks'] / res['window']:.0f} acks/s of {offered:.0f} offered")
    print(f"false NODE_LOST events: {res['lost_events_window']} in the window, {res['lost_events_total']} in all; "
          f"ack timeouts {res['ack_timeouts']}, rejoins {res['rejoins']}; events seen {res['events']}")
    if res["query_ok"]:
        print(f"final QUERY ({res['query_s'] * 1e3:.0f} ms): {res['query_nodes']} simulated nodes known, "
              f"{res['query_not_connected']} not connected; master {'alive' if master_alive else 'DEAD'}")
    else:
        print(f"final QUERY: no answer within {args.query_timeout:g} s; master {'alive' if master_alive else 'DEAD'}")
    print(load.report())
    vis = res["visibility"]
    vis_max = max(vis, default=float("nan"))
    print(f"node visibility at {args.clients} clients: {len(vis)} (client, node) pairs seen, {res['unseen']} never; "
          f"delay after JOINED p50 {pct(vis, 50) * 1e3:.0f} ms, p99 {pct(vis, 99) * 1e3:.0f} ms, "
          f"max {vis_max * 1e3:.0f} ms (target: 2 heartbeat intervals = {2 * args.interval * 1e3:.0f} ms)")
    fresh_s, place_s, place_n = placement_cost(res["reply"]) if res["query_ok"] else (float("nan"),) * 2 + (0,)
    print(f"placement decision over {place_n} devices: {place_s * 1e3:.2f} ms ({fresh_s * 1e3:.2f} ms when it "
          "also reads a new QUERY reply, at most once per heartbeat interval)")
    if res["errors"]:
        print("first errors: " + "; ".join(res["errors"]))
    table = c.Table()
    table.add("master CPU", f"{res['master_cpu']:.1f} %", "-", "-", "< 10 %", res["master_cpu"] < 10)
    table.add("heartbeat RTT p50", f"{p50 * 1e3:.2f} ms", f"1 node {single * 1e3:.2f} ms", f"{p50 / single:.1f}x",
              "report", None)
    table.add("heartbeat RTT p99", f"{p99 * 1e3:.2f} ms", f"1 node {single * 1e3:.2f} ms", f"{p99 / single:.1f}x",
              "report", None)
    table.add("acks/s", f"{res['acks'] / res['window']:.0f}", f"offered {offered:.0f}",
              f"{res['acks'] / res['window'] / offered:.2f}x", "report", None)
    table.add("false NODE_LOST (window)", str(res["lost_events_window"]), "0", "-", "0",
              res["lost_events_window"] == 0)
    table.add("joined in time", f"{res['joined']}/{args.nodes}", f"{args.nodes}", f"{res['joined'] / args.nodes:.2f}x",
              "all", res["joined"] == args.nodes)
    if res["query_ok"]:
        table.add("not connected at end", str(res["query_not_connected"]), "0", "-", "0",
                  res["query_not_connected"] == 0)
    else:
        table.add("not connected at end", "no QUERY answer", "0", "-", "0", False)
    table.add("client sees node (max)", f"{vis_max * 1e3:.0f} ms", f"2 intervals {2 * args.interval * 1e3:.0f} ms",
              f"{vis_max / (2 * args.interval):.2f}x", "<= 1x", vis_max <= 2 * args.interval and res["unseen"] == 0)
    table.add("placement decision", f"{place_s * 1e3:.2f} ms", f"{place_n} devices", "-", "report", None)
    table.add("placement, new view", f"{fresh_s * 1e3:.2f} ms", f"{place_n} devices", "-", "report", None)
    table.print("bench_membership summary")
    if not master_alive:
        print("master output tail:\n" + "\n".join(output[-20:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
