"""The remote device against raw sockets, local torch and torch.distributed.rpc, in one run (issue 6).

    .venv/bin/python benchmarks/bench_remote.py            # about 1 minute on 2 cores
    .venv/bin/python benchmarks/bench_remote.py --quick    # fewer samples, no 1 GiB memory case

Starts a real ``genie serve --devices cpu`` (``--server-devices cuda:0`` on a GPU host) on loopback and connects with
``genie.init_sync``. Baselines, measured in the same run: a blocking-socket echo
server process (64 B round trip with TCP_NODELAY; bulk ``sendall``/``recv_into``),
local CPU matmul, and two ``torch.distributed.rpc`` processes (TensorPipe over
loopback TCP: the ``uv`` transport and ``basic`` channel, so rpc moves its bytes
the way genie does). The whole run is re-executed in a private network namespace
(``unshare -n``, only ``lo`` up), because rpc would otherwise look up the host
name off the machine; ``--no-netns`` runs in place.

Prints each figure with its ratio to a baseline and a closing table. Asserts
nothing; exits non-zero only if something crashes. Every child is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

# Client and server share this host's cores. libgomp's default keeps this process's OpenMP threads
# spinning for a while after each local parallel op, on the cores the server computes on next: a remote
# x @ x right after the local one took 12 to 13 ms instead of 9.6 to 10 (the local matmul is 6.0 ms
# either way). Set before torch loads libgomp; the server's workers set the same (WORKER_OMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PING_BYTES = 64
BULK_BYTES = 64 << 20
MATMUL_N = 1000
#: x @ x rounds measured (each about 25 ms with its baselines), after the warm-up rounds (first allocations).
MATMUL_ROUNDS, MATMUL_WARMUP = 15, 2
MEM_BYTES = 1 << 30

TARGET_TINY_VS_RAW = 6.0
TARGET_PIPELINED_OPS = 40_000
TARGET_MATMUL_VS_WIRE = 1.15
TARGET_BULK_VS_RAW = 0.9  # issue 16; benchmarks/bench_transfer.py measures the same with a reused destination too
TARGET_BULK_VS_RPC = 2.0
TARGET_PEAK_MEM = 1.25
TARGET_CLIENT_US_PER_OP = 15e-6
TARGET_GRAPH_STEP_VS_LOCAL = 1.15  # issue 33: a captured torch.accelerator.Graph training step


# ---------------------------------------------------------------------------------------------
# child: the raw-socket echo server
# ---------------------------------------------------------------------------------------------

def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _serve_echo_connection(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        mode = bytearray(1)
        try:
            _recv_exactly(conn, memoryview(mode))
            if mode == b"P":  # ping: echo fixed-size messages until the peer closes
                buf = bytearray(PING_BYTES)
                view = memoryview(buf)
                while True:
                    _recv_exactly(conn, view)
                    conn.sendall(view)
            else:  # bulk: [u64 n] then n bytes up, then the same n bytes down; n == 0 ends
                buf = bytearray(BULK_BYTES)
                size = bytearray(8)
                while True:
                    _recv_exactly(conn, memoryview(size))
                    (n,) = struct.unpack("<Q", size)
                    if n == 0:
                        return
                    if n > len(buf):
                        buf = bytearray(n)
                    view = memoryview(buf)[:n]
                    _recv_exactly(conn, view)
                    conn.sendall(view)
        except (ConnectionError, OSError):
            return


def child_echo() -> int:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    c.emit({"port": listener.getsockname()[1]})
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_echo_connection, args=(conn,), daemon=True).start()


# ---------------------------------------------------------------------------------------------
# child: torch.distributed.rpc peers
# ---------------------------------------------------------------------------------------------

_REMOTE_X: Any = None


def _rpc_tiny() -> float:
    """The tiny op on a tensor that lives in the rpc peer, as genie's lives on its server."""
    global _REMOTE_X
    import torch

    if _REMOTE_X is None:
        _REMOTE_X = torch.ones(16)
    return (_REMOTE_X + 1).sum().item()


def _rpc_identity(t: Any) -> Any:
    return t


def child_rpc(rank: int, port: int, samples: int) -> int:
    import torch
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8,
                                           rpc_timeout=120, _transports=["uv"], _channels=["basic"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank == 0:
            for _ in range(200):
                rpc.rpc_sync("worker1", _rpc_tiny)
            lat = []
            for _ in range(samples):
                t0 = time.perf_counter()
                rpc.rpc_sync("worker1", _rpc_tiny)
                lat.append(time.perf_counter() - t0)
            big = torch.randn(BULK_BYTES // 4)
            rpc.rpc_sync("worker1", _rpc_identity, args=(big,))
            bulk = []
            for _ in range(3):
                t0 = time.perf_counter()
                back = rpc.rpc_sync("worker1", _rpc_identity, args=(big,))
                bulk.append(time.perf_counter() - t0)
            c.emit({"tiny_median": statistics.median(lat), "tiny_p99": _pct(lat, 99),
                    "bulk_median": statistics.median(bulk), "bulk_ok": bool(torch.equal(back, big))})
    finally:
        rpc.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------
# child: a fresh client for the 1 GiB upload
# ---------------------------------------------------------------------------------------------

def child_memclient(port: int) -> int:
    import torch

    import genie

    genie.init_sync(master_addr="127.0.0.1", master_port=port)
    try:
        dev = "remote_accelerator:0"
        torch.ones(4, device=dev).sum().item()  # the session and the device are warm
        rss_before = c.vm_status()["VmRSS"]
        t = torch.empty(MEM_BYTES // 4, dtype=torch.float32).fill_(1.5)
        rss_with_tensor = c.vm_status()["VmRSS"]
        reset = c.reset_peak_rss()
        t0 = time.perf_counter()
        x = t.to(dev)
        torch.remote_accelerator.synchronize()  # type: ignore[attr-defined]  # added by genie
        upload_s = time.perf_counter() - t0
        hwm = c.vm_status()["VmHWM"]
        c.emit({"rss_before": rss_before, "rss_with_tensor": rss_with_tensor, "hwm_after": hwm,
                "reset": reset, "upload_s": upload_s, "numel": x.numel()})
        del x
    finally:
        genie.shutdown_sync()
    return 0


# ---------------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------------

def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


class RawPeer:
    """Two blocking TCP connections to the echo server: one for 64 B pings, one for bulk transfers.

    Kept open for the whole run, so raw figures can be taken in blocks interleaved with
    genie's: both then see the same machine (the benchmarks share their cores).
    """

    def __init__(self, port: int) -> None:
        self.ping_sock = socket.create_connection(("127.0.0.1", port))
        self.bulk_sock = socket.create_connection(("127.0.0.1", port))
        for sock, mode in ((self.ping_sock, b"P"), (self.bulk_sock, b"B")):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(mode)
        self.msg = bytes(PING_BYTES)
        self.pong = memoryview(bytearray(PING_BYTES))
        self.data = memoryview(bytearray(os.urandom(1 << 20)) * (BULK_BYTES >> 20))
        self.back = memoryview(bytearray(BULK_BYTES))
        self.ping(200)
        self.bulk(BULK_BYTES)

    def ping(self, samples: int) -> list[float]:
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            self.ping_sock.sendall(self.msg)
            _recv_exactly(self.ping_sock, self.pong)
            out.append(time.perf_counter() - t0)
        return out

    def bulk(self, nbytes: int) -> float:
        """Seconds for nbytes up, then the same bytes back down (into a buffer reused every time)."""
        t0 = time.perf_counter()
        self.bulk_sock.sendall(struct.pack("<Q", nbytes))
        self.bulk_sock.sendall(self.data[:nbytes])
        _recv_exactly(self.bulk_sock, self.back[:nbytes])
        return time.perf_counter() - t0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.bulk_sock.sendall(struct.pack("<Q", 0))
        self.ping_sock.close()
        self.bulk_sock.close()


def local_matmul_once(a: Any) -> float:
    t0 = time.perf_counter()
    a @ a
    return time.perf_counter() - t0


def measure_rpc(kids: c.Children, samples: int) -> dict[str, Any]:
    port = c.free_port()
    me = [sys.executable, os.path.abspath(__file__)]
    peer = kids.start([*me, "--role", "rpc", "--rank", "1", "--rpc-port", str(port)])
    main = kids.start([*me, "--role", "rpc", "--rank", "0", "--rpc-port", str(port), "--samples", str(samples)])
    try:
        return c.read_json_line(main, 120)
    finally:
        for p in (main, peer):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                pass
            kids.stop(p)


def measure_genie(port: int, raw: RawPeer, samples: int, pipelined_ops: int, rounds: int,
                  pin_groups: list[int]) -> dict[str, Any]:
    """genie's figures, each in blocks interleaved with the matching raw baseline; ``pin_groups``: the process
    groups of the node and of the raw peer, pinned with this thread for the pinned figures."""
    import torch

    import genie

    t0 = time.perf_counter()
    state = genie.init_sync(master_addr="127.0.0.1", master_port=port)
    out: dict[str, Any] = {"init_s": time.perf_counter() - t0, "backend": state.backend}
    try:
        dev = "remote_accelerator:0"
        x = torch.ones(16, device=dev)
        for _ in range(200):
            (x + 1).sum().item()
        out["tiny"], out["raw_ping"] = _tiny_blocks(x, raw, samples)

        # The same with client and server pinned to one CPU (taskset -c 0 on this thread, every thread of
        # the node and its workers, and the raw echo peer): no cross-CPU wake-up on either path.
        with c.pinned(pin_groups, {min(os.sched_getaffinity(0))}):
            out["tiny_pinned"], out["raw_ping_pinned"] = _tiny_blocks(x, raw, samples)

        rates, client_cpu, local_op = [], [], []
        for _ in range(3):
            y = torch.zeros(1, device=dev)
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(pipelined_ops):
                y = y + 1
            c1 = time.thread_time()
            value = y.item()
            rates.append(pipelined_ops / (time.perf_counter() - t0))
            client_cpu.append((c1 - c0) / pipelined_ops)  # encode + queue + send, this thread's CPU only
            out["pipelined_ok"] = value == pipelined_ops
            z = torch.zeros(1)
            t0 = time.perf_counter()
            for _ in range(pipelined_ops):
                z = z + 1
            local_op.append((time.perf_counter() - t0) / pipelined_ops)
        out["pipelined"], out["client_cpu_per_op"], out["local_op"] = rates, client_cpu, local_op

        # Adaptive batches: the connection first measures small-first against full batches (after the
        # workload's first DISCARD steps, WARMUP steps of each: genie.device.flushing), so those warm-up
        # steps are left out like the meta cache's.
        from genie.device import connection, flushing, registry

        warmup = 2 + flushing.DISCARD + 2 * flushing.WARMUP
        out["step_client"], out["step_remote"], out["step_local"] = _transformer_steps(dev, rounds, warmup=warmup)
        policy = registry.table().get(0).connection.flush_policy
        out["flush_choice"], out["flush_medians"] = policy.choice, policy.medians()
        # The same step with fixed 512-command batches (the flush policy before adaptive batches).

        adaptive = connection.MIN_BATCH_CMDS
        connection.MIN_BATCH_CMDS = connection.MAX_BATCH_CMDS
        try:
            # As many warm-up steps as above: a model's steps are timed at the same positions in both
            # phases (with 2 warm-up steps here the fixed phase timed a fresh model's first steps).
            _, out["step_remote_fixed"], _ = _transformer_steps(dev, rounds, warmup=warmup)
        finally:
            connection.MIN_BATCH_CMDS = adaptive

        out["step_graph"], out["step_graph_local"], out["step_graph_ok"] = _captured_steps(dev, rounds)

        a = torch.randn(MATMUL_N, MATMUL_N)
        expect = a @ a
        mm, mm_local, mm_wire = [], [], []
        for i in range(MATMUL_ROUNDS + MATMUL_WARMUP):
            local_s = local_matmul_once(a)
            wire_s = raw.bulk(MATMUL_N * MATMUL_N * 4)
            t0 = time.perf_counter()
            r = _remote_square(a, dev).cpu()
            if i >= MATMUL_WARMUP:
                mm.append(time.perf_counter() - t0)
                mm_local.append(local_s)
                mm_wire.append(wire_s)
        out["matmul"], out["matmul_local"], out["matmul_wire"] = mm, mm_local, mm_wire
        out["matmul_ok"] = bool(torch.allclose(r, expect, rtol=1e-4, atol=1e-3))

        bulk = bulk_rounds(raw, 3)
        out["bulk_up"], out["bulk_down"], out["raw_bulk"] = bulk["up"], bulk["down"], bulk["raw"]
        out["bulk_ok"] = bulk["ok"]
    finally:
        genie.shutdown_sync()
    return out


def _tiny_blocks(x: Any, raw: RawPeer, samples: int, blocks: int = 10) -> tuple[list[float], list[float]]:
    """(x + 1).sum().item() round trips and raw 64 B round trips, in interleaved blocks."""
    lat: list[float] = []
    raw_lat: list[float] = []
    for _ in range(blocks):
        raw_lat += raw.ping(samples // blocks)
        for _ in range(samples // blocks):
            t0 = time.perf_counter()
            (x + 1).sum().item()
            lat.append(time.perf_counter() - t0)
    return lat, raw_lat


def _transformer_steps(dev: str, rounds: int, warmup: int = 2) -> tuple[list[float], list[float], list[float]]:
    """A 2-layer transformer training step (forward, backward, AdamW): this thread's CPU time and the
    wall time of the step on the remote device (to its loss.item()), and the same step on the local CPU."""
    import torch
    from torch import nn

    def make(device: str) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(8, 16, 64).to(device)

    def step(model: Any, opt: Any, x: Any) -> float:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    client, remote, local = [], [], []
    rm, ro, rx = make(dev)
    lm, lo, lx = make("cpu")
    for i in range(rounds + warmup):
        t0, c0 = time.perf_counter(), time.thread_time()
        step(rm, ro, rx)
        c1, t1 = time.thread_time(), time.perf_counter()
        step(lm, lo, lx)
        t2 = time.perf_counter()
        if i >= warmup:  # the first steps fill the meta cache
            client.append(c1 - c0)
            remote.append(t1 - t0)
            local.append(t2 - t1)
    return client, remote, local


def _captured_steps(dev: str, rounds: int, warmup: int = 3) -> tuple[list[float], list[float], bool]:
    """The same 2-layer transformer training step, captured once as a torch.accelerator.Graph on the remote
    device and replayed (one command, then loss.item()), against the step on the local CPU; both with fused
    AdamW (a captured optimizer keeps its step on the device). Also whether the two losses agree."""
    import torch
    from torch import nn

    def make(device: str) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), torch.randn(8, 16, 64).to(device)

    def step(model: Any, opt: Any, x: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    rm, ro, rx = make(dev)
    lm, lo, lx = make("cpu")
    step(rm, ro, rx).item()  # the optimizer's state exists before the capture, as for CUDA graphs
    step(lm, lo, lx).item()
    graph = torch.accelerator.Graph()
    with graph:
        static_loss = step(rm, ro, rx)
    graph_s, local_s, ok = [], [], True
    for i in range(rounds + warmup):
        t0 = time.perf_counter()
        graph.replay()
        remote_loss = static_loss.item()
        t1 = time.perf_counter()
        local_loss = step(lm, lo, lx).item()
        t2 = time.perf_counter()
        ok = ok and abs(remote_loss - local_loss) <= 1e-4 * max(1.0, abs(local_loss))
        if i >= warmup:
            graph_s.append(t1 - t0)
            local_s.append(t2 - t1)
    return graph_s, local_s, ok


def _remote_square(a: Any, dev: str) -> Any:
    x = a.to(dev)
    return x @ x


def measure_memory(kids: c.Children, server_devices: str) -> dict[str, Any]:
    from genie.cluster.launch import NodeProcess

    with NodeProcess("serve", "--port", "0", "--devices", server_devices) as server:
        c.quiet(server)
        port = server.control_port  # --port 0: any free port, bound
        client = kids.start([sys.executable, os.path.abspath(__file__), "--role", "memclient",
                             "--genie-port", str(port)])
        try:
            server_before = c.vm_status(server.pid)
            server_reset = c.reset_peak_rss(server.pid)
            res = c.read_json_line(client, 120)
            server_after = c.vm_status(server.pid)
        finally:
            try:
                client.wait(20)
            except subprocess.TimeoutExpired:
                pass
            kids.stop(client)
    # The server may have grown before the reset (client's handshake); its baseline is the RSS at reset.
    res["server_before"] = server_before["VmRSS"]
    res["server_hwm"] = server_after["VmHWM"]
    res["server_reset"] = server_reset
    return res


def bulk_rounds(raw: RawPeer, rounds: int, *, reused: bool = False) -> dict[str, Any]:
    """64 MiB ``x.to(dev)`` + synchronize, then ``.cpu()`` (and, ``reused``, ``buf.copy_(remote)`` into one
    tensor kept across rounds), each round after a raw echo of the same bytes; a first round warms both."""
    import torch

    dev = "remote_accelerator:0"
    big = torch.randn(BULK_BYTES // 4)
    buf = torch.empty_like(big) if reused else None
    out: dict[str, Any] = {"up": [], "down": [], "down_into": [], "raw": []}
    ok = True
    for i in range(rounds + 1):
        raw_s = raw.bulk(BULK_BYTES)
        t0 = time.perf_counter()
        rx = big.to(dev)
        torch.remote_accelerator.synchronize()  # type: ignore[attr-defined]  # added by genie
        t1 = time.perf_counter()
        back = rx.cpu()
        t2 = time.perf_counter()
        if buf is not None:
            buf.copy_(rx)  # into memory the caller reuses, as the raw echo does
            ok = ok and bool(torch.equal(buf, big))
        t3 = time.perf_counter()
        del rx
        ok = ok and bool(torch.equal(back, big))
        if i:
            out["up"].append(t1 - t0)
            out["down"].append(t2 - t1)
            out["down_into"].append(t3 - t2)
            out["raw"].append(raw_s)
    out["ok"] = ok
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples; skip the 1 GiB memory case")
    parser.add_argument("--no-netns", action="store_true", help="run in place, not in a private network namespace")
    parser.add_argument("--role", default="parent", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rpc-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--genie-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=2000, help="round trips per latency figure")
    parser.add_argument("--server-devices", default="cpu",
                        help="the server's --devices (cuda:0 on a GPU host; the local baselines stay on the CPU)")
    args = parser.parse_args()
    if args.role == "echo":
        return child_echo()
    if args.role == "rpc":
        return child_rpc(args.rank, args.rpc_port, args.samples)
    if args.role == "memclient":
        return child_memclient(args.genie_port)

    c.enter_private_netns()
    samples = 500 if args.quick else args.samples
    rounds = 3 if args.quick else 7
    with c.sigterm_raises(), c.Children() as kids:
        return run_parent(kids, args, samples, rounds)


def run_parent(kids: c.Children, args: argparse.Namespace, samples: int, rounds: int) -> int:
    import torch

    from genie.cluster.launch import NodeProcess

    print(f"bench_remote: torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"network namespace: {'private' if os.environ.get(c.NETNS_ENV) == '1' else 'host'}, "
          f"server devices: {args.server_devices}")
    table = c.Table()
    load = c.MachineLoad()

    # -- baselines ------------------------------------------------------------------------------
    # The raw figures are taken again inside the genie phase, interleaved with genie's, and
    # genie's ratios use those; the ones here are the baselines for the rpc anchor, run just before it.
    echo = kids.start([sys.executable, os.path.abspath(__file__), "--role", "echo"])
    raw = RawPeer(c.read_json_line(echo, 30)["port"])
    try:
        ping = raw.ping(samples)
        raw_rtt = statistics.median(ping)
        raw_bulk_s = statistics.median(raw.bulk(BULK_BYTES) for _ in range(3))
        raw_bulk_rate = 2 * BULK_BYTES / raw_bulk_s
        print(f"raw socket 64 B round trip: median {c.fmt_us(raw_rtt)}, p99 {c.fmt_us(_pct(ping, 99))}  (baseline)")
        print(f"raw TCP 64 MiB up + down: {c.fmt_ms(raw_bulk_s)} = {c.fmt_rate(raw_bulk_rate)}  (baseline)")

        rpc = measure_rpc(kids, samples)
        rpc_rate = 2 * BULK_BYTES / rpc["bulk_median"]
        print(f"rpc_sync tiny op: median {c.fmt_us(rpc['tiny_median'])}, p99 {c.fmt_us(rpc['tiny_p99'])} "
              f"= {rpc['tiny_median'] / raw_rtt:.1f}x raw  (anchor)")
        print(f"rpc_sync 64 MiB there and back: {c.fmt_ms(rpc['bulk_median'])} = {c.fmt_rate(rpc_rate)} "
              f"= {rpc_rate / raw_bulk_rate:.2f}x raw{'' if rpc['bulk_ok'] else '  (CONTENT MISMATCH)'}  (anchor)")

        # -- genie --------------------------------------------------------------------------------
        with NodeProcess("serve", "--port", "0", "--devices", args.server_devices) as server:
            c.quiet(server)
            port = server.control_port  # --port 0: any free port, bound
            g = measure_genie(port, raw, samples, 20_000 if not args.quick else 5_000, rounds,
                              [server.pid, echo.pid])
    finally:
        raw.close()
        kids.stop(echo)

    raw_rtt = statistics.median(g["raw_ping"])
    raw_bulk_rate = 2 * BULK_BYTES / statistics.median(g["raw_bulk"])
    wire_mm, mm_local = statistics.median(g["matmul_wire"]), statistics.median(g["matmul_local"])
    print(f"interleaved with genie: raw 64 B round trip {c.fmt_us(raw_rtt)}; raw 64 MiB up + down "
          f"{c.fmt_rate(raw_bulk_rate)}; raw 4 MB up + 4 MB down {c.fmt_ms(wire_mm)}; local CPU x @ x "
          f"({MATMUL_N}x{MATMUL_N} float32) {c.fmt_ms(mm_local)}  (baselines of the lines below)")
    tiny = statistics.median(g["tiny"])
    print(f"genie init (warm imports): {c.fmt_ms(g['init_s'])}, backend {g['backend']}")
    print(f"genie (x + 1).sum().item(): median {c.fmt_us(tiny)}, p99 {c.fmt_us(_pct(g['tiny'], 99))} "
          f"= {tiny / raw_rtt:.2f}x raw (target <= {TARGET_TINY_VS_RAW:g}x), "
          f"{tiny / rpc['tiny_median']:.2f}x rpc_sync (target < 1x)")
    table.add("tiny op + .item()", c.fmt_us(tiny), f"raw RTT {c.fmt_us(raw_rtt)}", f"{tiny / raw_rtt:.2f}x",
              f"<= {TARGET_TINY_VS_RAW:g}x", tiny / raw_rtt <= TARGET_TINY_VS_RAW)
    table.add("tiny op + .item()", c.fmt_us(tiny), f"rpc_sync {c.fmt_us(rpc['tiny_median'])}",
              f"{tiny / rpc['tiny_median']:.2f}x", "< 1x", tiny < rpc["tiny_median"])

    tiny_pinned, raw_pinned = statistics.median(g["tiny_pinned"]), statistics.median(g["raw_ping_pinned"])
    print(f"genie (x + 1).sum().item() pinned to one CPU: median {c.fmt_us(tiny_pinned)} vs raw round trip pinned "
          f"{c.fmt_us(raw_pinned)} = {tiny_pinned / raw_pinned:.2f}x (target <= {TARGET_TINY_VS_RAW:g}x)")
    table.add("tiny op + .item(), pinned", c.fmt_us(tiny_pinned), f"raw RTT pinned {c.fmt_us(raw_pinned)}",
              f"{tiny_pinned / raw_pinned:.2f}x", f"<= {TARGET_TINY_VS_RAW:g}x",
              tiny_pinned / raw_pinned <= TARGET_TINY_VS_RAW)

    per_op, local_op = statistics.median(g["client_cpu_per_op"]), statistics.median(g["local_op"])
    print(f"genie client CPU per queued op (y = y + 1, encode + queue + send): {c.fmt_us(per_op)} "
          f"vs the same op on the local CPU {c.fmt_us(local_op)} = {per_op / local_op:.1f}x "
          f"(target <= {c.fmt_us(TARGET_CLIENT_US_PER_OP)})")
    table.add("client CPU per queued op", c.fmt_us(per_op), f"local op {c.fmt_us(local_op)}",
              f"{per_op / local_op:.1f}x", f"<= {c.fmt_us(TARGET_CLIENT_US_PER_OP)}",
              per_op <= TARGET_CLIENT_US_PER_OP)

    step_client, step_remote = statistics.median(g["step_client"]), statistics.median(g["step_remote"])
    step_local = statistics.median(g["step_local"])
    print(f"genie 2-layer transformer training step: client CPU {c.fmt_ms(step_client)}, wall {c.fmt_ms(step_remote)} "
          f"vs the step on the local CPU {c.fmt_ms(step_local)}: client CPU {step_client / step_local:.2f}x local")
    table.add("transformer step, client CPU", c.fmt_ms(step_client), f"local step {c.fmt_ms(step_local)}",
              f"{step_client / step_local:.2f}x", "report", None)
    step_fixed = statistics.median(g["step_remote_fixed"])
    print(f"genie 2-layer transformer training step, wall: adaptive batches {c.fmt_ms(step_remote)} vs fixed "
          f"512-command batches {c.fmt_ms(step_fixed)} = {step_remote / step_fixed:.2f}x; local CPU "
          f"{c.fmt_ms(step_local)} = {step_remote / step_local:.2f}x local")
    medians = ", ".join(f"{k} {c.fmt_us(v) if v else '-'}/op" for k, v in g["flush_medians"].items())
    print(f"  adaptive flush chose {g['flush_choice']} first batches (measured: {medians})")
    table.add("transformer step, wall", c.fmt_ms(step_remote), f"local step {c.fmt_ms(step_local)}",
              f"{step_remote / step_local:.2f}x", "report", None)
    table.add("transformer step, wall", c.fmt_ms(step_remote), f"fixed batches {c.fmt_ms(step_fixed)}",
              f"{step_remote / step_fixed:.2f}x", "report", None)

    step_graph, step_graph_local = statistics.median(g["step_graph"]), statistics.median(g["step_graph_local"])
    graph_ratio = step_graph / step_graph_local
    print(f"genie 2-layer transformer training step captured as a torch.accelerator.Graph (replay + loss.item()): "
          f"{c.fmt_ms(step_graph)}{'' if g['step_graph_ok'] else '  (LOSS MISMATCH)'} vs the step on the local CPU "
          f"(fused AdamW both) {c.fmt_ms(step_graph_local)} = {graph_ratio:.2f}x "
          f"(target <= {TARGET_GRAPH_STEP_VS_LOCAL:g}x)")
    table.add("transformer step, captured graph", c.fmt_ms(step_graph), f"local step {c.fmt_ms(step_graph_local)}",
              f"{graph_ratio:.2f}x", f"<= {TARGET_GRAPH_STEP_VS_LOCAL:g}x",
              graph_ratio <= TARGET_GRAPH_STEP_VS_LOCAL and g["step_graph_ok"])

    rate = statistics.median(g["pipelined"])
    print(f"genie pipelined y = y + 1: {rate:,.0f} ops/s (runs: {', '.join(f'{r:,.0f}' for r in g['pipelined'])})"
          f"{'' if g['pipelined_ok'] else '  (WRONG RESULT)'} = {rate / TARGET_PIPELINED_OPS:.2f}x of the "
          f"{TARGET_PIPELINED_OPS:,}/s target; raw RTT would allow {1 / raw_rtt:,.0f} blocking ops/s")
    table.add("pipelined tiny ops", f"{rate:,.0f}/s", f"1/raw RTT {1 / raw_rtt:,.0f}/s",
              f"{rate * raw_rtt:.2f}x", f">= {TARGET_PIPELINED_OPS:,}/s", rate >= TARGET_PIPELINED_OPS)

    mm = statistics.median(g["matmul"])
    mm_base = mm_local + wire_mm
    print(f"genie x @ x with upload and download: {c.fmt_ms(mm)}{'' if g['matmul_ok'] else '  (WRONG RESULT)'} "
          f"vs local {c.fmt_ms(mm_local)} + wire {c.fmt_ms(wire_mm)} = {c.fmt_ms(mm_base)}: "
          f"{mm / mm_base:.2f}x (target <= {TARGET_MATMUL_VS_WIRE:g}x)")
    table.add("remote x @ x (1000^2)", c.fmt_ms(mm), f"local+wire {c.fmt_ms(mm_base)}", f"{mm / mm_base:.2f}x",
              f"<= {TARGET_MATMUL_VS_WIRE:g}x", mm / mm_base <= TARGET_MATMUL_VS_WIRE)

    up, down = statistics.median(g["bulk_up"]), statistics.median(g["bulk_down"])
    total = statistics.median([u + d for u, d in zip(g["bulk_up"], g["bulk_down"], strict=True)])
    grate = 2 * BULK_BYTES / total
    print(f"genie 64 MiB upload {c.fmt_ms(up)} ({c.fmt_rate(BULK_BYTES / up)}), download {c.fmt_ms(down)} "
          f"({c.fmt_rate(BULK_BYTES / down)}), together {c.fmt_rate(grate)}"
          f"{'' if g['bulk_ok'] else '  (CONTENT MISMATCH)'}: {grate / raw_bulk_rate:.2f}x raw TCP "
          f"(target >= {TARGET_BULK_VS_RAW:g}x), {grate / rpc_rate:.2f}x rpc (target >= {TARGET_BULK_VS_RPC:g}x)")
    table.add("64 MiB up+down", c.fmt_rate(grate), f"raw TCP {c.fmt_rate(raw_bulk_rate)}",
              f"{grate / raw_bulk_rate:.2f}x", f">= {TARGET_BULK_VS_RAW:g}x", grate / raw_bulk_rate >= TARGET_BULK_VS_RAW)
    table.add("64 MiB up+down", c.fmt_rate(grate), f"rpc {c.fmt_rate(rpc_rate)}", f"{grate / rpc_rate:.2f}x",
              f">= {TARGET_BULK_VS_RPC:g}x", grate / rpc_rate >= TARGET_BULK_VS_RPC)

    # -- memory ---------------------------------------------------------------------------------
    if not args.quick:
        m = measure_memory(kids, args.server_devices)
        gib = float(MEM_BYTES)
        client_peak = m["hwm_after"] - m["rss_before"]
        server_peak = m["server_hwm"] - m["server_before"]
        note = "" if m["reset"] and m["server_reset"] else " (peak RSS could not be reset: figures are upper bounds)"
        print(f"1 GiB upload in {m['upload_s']:.2f} s ({c.fmt_rate(gib / m['upload_s'])}){note}")
        print(f"  client peak RSS above its pre-tensor RSS: {client_peak / gib:.3f}x the tensor "
              f"({client_peak / (1 << 20):.0f} MiB; the tensor itself {(m['rss_with_tensor'] - m['rss_before']) / (1 << 20):.0f} MiB)")
        print(f"  server peak RSS above its RSS before: {server_peak / gib:.3f}x the tensor ({server_peak / (1 << 20):.0f} MiB)")
        table.add("client peak mem, 1 GiB up", f"{client_peak / (1 << 20):.0f} MiB", "tensor 1024 MiB",
                  f"{client_peak / gib:.2f}x", f"<= {TARGET_PEAK_MEM:g}x", client_peak / gib <= TARGET_PEAK_MEM)
        table.add("server peak mem, 1 GiB up", f"{server_peak / (1 << 20):.0f} MiB", "tensor 1024 MiB",
                  f"{server_peak / gib:.2f}x", f"<= {TARGET_PEAK_MEM:g}x", server_peak / gib <= TARGET_PEAK_MEM)

    print(load.report())
    table.print("bench_remote summary")
    print(f"missed: {', '.join(sorted(set(table.missed))) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
