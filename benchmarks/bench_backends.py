"""Every data-plane backend that works here against raw TCP and against its own raw library, in one run.

    python benchmarks/bench_backends.py [--mib 64] [--repeat 5] [--rtts 2000] [--ops 300] [--backend shm,tcp]
                                        [--no-af-packet] [--no-ops]

For each backend: an echo server in a child process (its own interpreter, so the
two ends never share a GIL) listening with the backend's ``listen``, and this
process connecting with its ``connect``; then

- **64 B round trip**: median of ``--rtts`` request/answer pairs of 64 bytes;
- **64 MiB up+down**: a buffer sent to the server and received back whole, best
  of ``--repeat`` (GB/s counts both directions);

against **raw TCP** (plain sockets, ``sendall``/``recv_into``, same sizes) measured in
the same run (``rdma`` runs NIXL over whatever ``UCX_TLS`` says: run the script once with
``UCX_TLS=tcp`` and once with ``UCX_TLS=shm,self`` for both figures). Each backend's channel is told its handshake is complete right after
connecting (there is no genie handshake here), so shm moves to its rings at once.

Right after each backend, the same two figures for its **raw library** (a second table,
ratio genie / raw):

- ``shm``: two processes, one memfd segment per direction, a Unix socket pair for
  notifications; a request is copy into the up segment + notify, the far end copies it
  out and into the down segment + notifies, copy out (the copies genie's rings make, with
  no ring, records or credit). It moves the whole buffer before notifying, so genie's
  rings, whose reader copies out while the writer still copies in, can beat it on bulk;
- ``rdma``: raw NIXL (``nixl_cu12._api``, UCX backend, configured as genie_rdma does but
  driven by busy polls instead of a progress thread): each process registers ONE
  ``--mib`` buffer once and the agents exchange metadata once over a socket (all outside
  the timing). 64 B round trip: a READ of 64 B + notification one way, then the other;
  up+down: the far end, told over the socket, READs the buffer (notification), then this
  process READs it back (notification), every byte checked;
- ``tcp``: its raw library is the raw TCP row;
- ``dpdk``: not measured: genie_dpdk's shim offers only its own reliable stream, and a
  raw DPDK echo (rte_eth_tx/rx_burst) needs C code that nothing here provides.

Then the **tiny op**: one real node (``genie serve --devices cpu`` serving every installed
backend of tcp, shm, dpdk, rdma; rdma only when ``UCX_TLS`` lets its probe pass) and per
backend a client process (``GENIE_BACKEND=<name>``) timing ``(x + 1).item()`` on
``remote_accelerator:0``: median of ``--ops`` after 50 warm-ups, its ratio in raw TCP 64 B
round trips; a session that used another backend than asked is an error (``--no-ops``
skips this part; the node and every client are stopped on every path).

For ``dpdk`` it also prints the DPDK stream's counters (retransmits: zero on memif means
no frame was lost), and, as root, moves ``--mib`` MiB both ways over ``net_af_packet``
between two network namespaces joined by a veth pair (MTU 9000) with 5 % of received
frames dropped (seeded) at both ends, checking every byte (``--no-af-packet`` skips it).
A backend named in ``--backend`` that cannot work here is reported with its reason
and makes the run exit 1 (never a silent skip); without ``--backend`` every
installed backend is tried and the ones that cannot work are listed with why. A raw
library figure that fails, or a tiny op whose session used the wrong backend, also
makes the run exit 1.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REQUEST = struct.Struct("<BQ")  # op, size
ECHO, BULK, STOP = 1, 2, 3


# -- servers (child processes) ----------------------------------------------------------------

def serve_raw() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(REQUEST.size)
    buf = bytearray()
    while True:
        if conn.recv_into(head, REQUEST.size, socket.MSG_WAITALL) < REQUEST.size:
            return
        op, size = REQUEST.unpack(head)
        if op == STOP:
            return
        if len(buf) < size:
            buf = bytearray(size)
        view = memoryview(buf)[:size]
        got = 0
        while got < size:
            got += conn.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        conn.sendall(view)


def serve_backend(name: str) -> None:
    from genie.plugins import PluginManager

    transport = PluginManager().transports()[name]()
    listener = transport.listen("127.0.0.1", 0)
    print(listener.port, flush=True)
    channel = listener.accept(timeout=30)
    channel.settimeout(60)
    head = bytearray(REQUEST.size)
    buf = bytearray()
    while True:
        channel.recv_into(memoryview(head))
        op, size = REQUEST.unpack(head)
        if op == STOP:
            channel.close()
            listener.close()
            return
        if len(buf) < size:
            buf = bytearray(size)
        view = memoryview(buf)[:size]
        channel.recv_into(view)
        channel.sendv([view])


def serve_raw_shm(fds: str) -> None:
    """The raw shared-memory floor's far end: a Unix socket for notifications, one memfd segment per direction.

    On each notification (op, size) it copies ``size`` bytes out of the up segment into its own
    buffer, copies them into the down segment and notifies back: one copy into a segment and one
    out of it per direction, as genie's rings do.
    """
    import mmap

    sock_fd, up_fd, down_fd = (int(f) for f in fds.split(","))
    sock = socket.socket(fileno=sock_fd)
    up = mmap.mmap(up_fd, os.fstat(up_fd).st_size)
    down = mmap.mmap(down_fd, os.fstat(down_fd).st_size)
    print(0, flush=True)
    head = bytearray(REQUEST.size)
    buf = bytearray()
    while True:
        if sock.recv_into(head, REQUEST.size, socket.MSG_WAITALL) < REQUEST.size:
            break
        op, size = REQUEST.unpack(head)
        if op == STOP:
            break
        if len(buf) < size:
            buf = bytearray(size)
        view = memoryview(buf)[:size]
        view[:] = memoryview(up)[:size]
        memoryview(down)[:size] = view
        sock.sendall(head)
    del view
    up.close()
    down.close()
    sock.close()


#: raw NIXL commands (this process -> the far end, over the TCP socket): op, count or size
RDMA_RTT, RDMA_UP = 1, 2


def nixl_agent(tag: str) -> Any:
    """A NIXL agent with the UCX backend, as genie_rdma.nixl_path.Agent makes its own but without a progress thread.

    The raw figure is the floor: its busy polls (check_xfer_state, check_remote_xfer_done, with
    sched_yield) drive UCX's progress themselves. With NIXL's progress thread as well, four threads
    spin on this 2-core machine and a 64 B round trip took 16-44 ms instead of ~11 us.
    """
    import logging

    from genie_rdma.nixl_path import load_nixl, shared_memory_only

    api = load_nixl()  # sets UCX_MODULES=^ib where there is no RDMA device (else UCX crashes at exit)
    logging.getLogger("nixl").setLevel(logging.WARNING)
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                   sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    agent = api.nixl_agent(f"bench-{tag}-{os.getpid()}", config)
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"}
                         if shared_memory_only(os.environ.get("UCX_TLS", "")) else {})
    return agent


def nixl_wait(agent: Any, handle: Any, state: str, timeout: float = 60.0) -> None:
    """Poll a posted transfer until NIXL says DONE (busy, yielding the CPU between polls: this is the floor)."""
    deadline = time.monotonic() + timeout
    while state == "PROC":
        os.sched_yield()
        state = agent.check_xfer_state(handle)
        if state == "PROC" and time.monotonic() > deadline:
            raise TimeoutError(f"NIXL transfer not done in {timeout:g} s")
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed (state {state})")


def nixl_await_notif(agent: Any, peer: str, tag: bytes, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not agent.check_remote_xfer_done(peer, tag):
        os.sched_yield()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no NIXL notification {tag!r} from {peer} in {timeout:g} s")


def exchange_nixl(sock: socket.socket, agent: Any, address: int) -> tuple[str, int]:
    """Send this agent's full metadata (its registered buffer included) and address; load the peer's."""
    mine = bytes(agent.get_agent_metadata())
    sock.sendall(struct.pack("<QQ", len(mine), address) + mine)
    head = bytearray(16)
    sock.recv_into(head, 16, socket.MSG_WAITALL)
    length, peer_address = struct.unpack("<QQ", head)
    meta = bytearray(length)
    got = 0
    while got < length:
        n = sock.recv_into(memoryview(meta)[got:], length - got)
        if n == 0:
            raise ConnectionError("the raw NIXL peer went away during the metadata exchange")
        got += n
    name = agent.add_remote_agent(bytes(meta))
    return (name.decode() if isinstance(name, bytes) else str(name)), peer_address


def serve_raw_rdma(nbytes: int) -> None:
    """The raw NIXL figure's far end: one buffer registered once; READs on command, notifications after each.

    RTT n: n times, wait for this process's notification ``p`` (the near end READ 64 B from us), then READ
    64 B from the near end with notification ``q``. UP size: READ ``size`` bytes of the near end's buffer
    into ours with notification ``u``, then wait for ``d`` (the near end READ them back).
    """
    import numpy as np

    agent = nixl_agent("far")
    buf = np.zeros(nbytes, dtype=np.uint8)
    address = int(buf.ctypes.data)
    reg = agent.register_memory([(address, nbytes, 0, "")], "DRAM")
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer, peer_address = exchange_nixl(sock, agent, address)
    head = bytearray(REQUEST.size)
    try:
        while sock.recv_into(head, REQUEST.size, socket.MSG_WAITALL) == REQUEST.size:
            op, size = REQUEST.unpack(head)
            if op == RDMA_RTT:
                local = agent.get_xfer_descs([(address, 64, 0)], "DRAM")
                far = agent.get_xfer_descs([(peer_address + 64, 64, 0)], "DRAM")
                handle = agent.initialize_xfer("READ", local, far, peer, b"q")
                for _ in range(size):
                    nixl_await_notif(agent, peer, b"p")
                    nixl_wait(agent, handle, agent.transfer(handle))
                handle.release()
            elif op == RDMA_UP:
                local = agent.get_xfer_descs([(address, size, 0)], "DRAM")
                far = agent.get_xfer_descs([(peer_address, size, 0)], "DRAM")
                handle = agent.initialize_xfer("READ", local, far, peer, b"u")
                nixl_wait(agent, handle, agent.transfer(handle))
                handle.release()
                nixl_await_notif(agent, peer, b"d")
            else:
                break
    finally:
        agent.deregister_memory(reg)
        agent.remove_remote_agent(peer)
        sock.close()
        listener.close()


# -- clients -------------------------------------------------------------------------------------

class Server:
    """A child echo server; stopped (killed if need be) on exit."""

    def __init__(self, kind: str, *extra: str, pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, *extra], stdout=subprocess.PIPE,
                                     text=True, pass_fds=pass_fds)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"{kind} server did not start")
        self.port = int(line)

    def stop(self) -> None:
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure(send: Callable[[list[Any]], None], recv: Callable[[memoryview], None], nbytes: int, repeat: int,
            rtts: int) -> dict[str, float]:
    small = os.urandom(64)
    back = bytearray(64)
    samples = []
    for _ in range(rtts):
        start = time.perf_counter()
        send([REQUEST.pack(ECHO, 64), small])
        recv(memoryview(back))
        samples.append(time.perf_counter() - start)
    assert bytes(back) == small, "64-byte echo came back wrong"
    data = os.urandom(nbytes)
    out = bytearray(nbytes)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        send([REQUEST.pack(BULK, nbytes), data])
        recv(memoryview(out))
        best = min(best, time.perf_counter() - start)
    assert out == data, "bulk echo came back wrong"
    send([REQUEST.pack(STOP, 0)])
    return {"rtt_us": statistics.median(samples) * 1e6, "gbps": 2 * nbytes / best / 1e9}


def run_raw(args: argparse.Namespace) -> dict[str, float]:
    server = Server("raw")
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def recv(view: memoryview) -> None:
            got = 0
            while got < view.nbytes:
                n = sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
                if n == 0:
                    raise ConnectionError("raw server went away")
                got += n

        def send(buffers: list[Any]) -> None:
            for b in buffers:
                sock.sendall(b)

        result = measure(send, recv, args.mib << 20, args.repeat, args.rtts)
        sock.close()
        return result
    finally:
        server.stop()


def run_backend(name: str, args: argparse.Namespace) -> dict[str, float]:
    from genie.plugins import PluginManager
    from genie.transport.base import handshake_complete

    server = Server(name)
    try:
        channel = PluginManager().transports()[name]().connect("127.0.0.1", server.port, timeout=10)
        channel.settimeout(60)
        handshake_complete(channel, {})
        result = measure(channel.sendv, channel.recv_into, args.mib << 20, args.repeat, args.rtts)
        result["channel"] = repr(channel)  # type: ignore[assignment]
        stats = getattr(channel, "stats", None)
        if stats is not None:
            counters = stats()
            result["channel"] += f" retransmits={counters.get('retransmits')} "  # type: ignore[operator]
            result["channel"] += f"frames={counters.get('tx_frames')}"  # type: ignore[operator]
        channel.close()
        return result
    finally:
        server.stop()


def run_raw_shm(args: argparse.Namespace) -> dict[str, float]:
    """shm's raw floor: two processes, a memfd segment per direction, a Unix socket pair for notifications.

    A request is: copy into the up segment, notify; the far end copies out and into the down
    segment, notifies back; copy out of the down segment (the same copies genie's rings make).
    """
    import mmap

    nbytes = args.mib << 20
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    segments: list[mmap.mmap] = []
    fds: list[int] = []
    server = None
    try:
        for direction in ("up", "down"):
            fd = os.memfd_create(f"bench-raw-shm-{direction}")
            fds.append(fd)
            os.ftruncate(fd, nbytes)
            segments.append(mmap.mmap(fd, nbytes))
        server = Server("raw-shm", f"{far.fileno()},{fds[0]},{fds[1]}", pass_fds=(far.fileno(), *fds))
        far.close()
        up, down = memoryview(segments[0]), memoryview(segments[1])
        head = bytearray(REQUEST.size)

        def send(buffers: list[Any]) -> None:
            if len(buffers) > 1:
                payload = memoryview(buffers[1]).cast("B")
                up[:payload.nbytes] = payload
            near.sendall(buffers[0])

        def recv(view: memoryview) -> None:
            if near.recv_into(head, REQUEST.size, socket.MSG_WAITALL) < REQUEST.size:
                raise ConnectionError("raw shm server went away")
            view[:] = down[:view.nbytes]

        result = measure(send, recv, nbytes, args.repeat, args.rtts)
        up.release()
        down.release()
        return result
    finally:
        near.close()
        far.close()
        if server is not None:
            server.stop()
        for seg in segments:
            seg.close()
        for fd in fds:
            os.close(fd)


def run_raw_rdma(args: argparse.Namespace) -> dict[str, float]:
    """NIXL's raw figure: each process ONE buffer registered once (outside the timing), metadata exchanged once.

    64 B round trip: this process READs 64 B of the far buffer (notification ``p``), the far end then
    READs 64 B of ours (notification ``q``), median of ``--rtts``. Up+down: this process tells the far end
    over the socket to READ ``--mib`` MiB of our buffer (notification ``u``), then READs them back
    (notification ``d``) into our buffer zeroed meanwhile (untimed); best of ``--repeat``, every byte checked.
    """
    import numpy as np

    nbytes = args.mib << 20
    server = Server("raw-rdma", str(nbytes))
    agent = reg = peer = None
    sock = None
    try:
        agent = nixl_agent("near")
        buf = np.zeros(nbytes, dtype=np.uint8)
        address = int(buf.ctypes.data)
        reg = agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer, peer_address = exchange_nixl(sock, agent, address)

        small = np.frombuffer(os.urandom(64), dtype=np.uint8)
        buf[64:128] = small  # what the far end reads back to us
        local = agent.get_xfer_descs([(address + 128, 64, 0)], "DRAM")
        far = agent.get_xfer_descs([(peer_address, 64, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, far, peer, b"p")
        sock.sendall(REQUEST.pack(RDMA_RTT, args.rtts))
        samples = []
        for _ in range(args.rtts):
            start = time.perf_counter()
            nixl_wait(agent, handle, agent.transfer(handle))
            nixl_await_notif(agent, peer, b"q")
            samples.append(time.perf_counter() - start)
        handle.release()
        if args.rtts >= 2 and not np.array_equal(buf[128:192], small):
            raise AssertionError("raw NIXL 64-byte round trip came back wrong")

        data = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        buf[:] = data
        local = agent.get_xfer_descs([(address, nbytes, 0)], "DRAM")
        far = agent.get_xfer_descs([(peer_address, nbytes, 0)], "DRAM")
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            sock.sendall(REQUEST.pack(RDMA_UP, nbytes))
            nixl_await_notif(agent, peer, b"u")
            took = time.perf_counter() - start
            buf[:] = 0
            start = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, far, peer, b"d")
            nixl_wait(agent, handle, agent.transfer(handle))
            took += time.perf_counter() - start
            handle.release()
            best = min(best, took)
            if not np.array_equal(buf, data):
                raise AssertionError("raw NIXL bulk up+down came back wrong")
        sock.sendall(REQUEST.pack(STOP, 0))
        return {"rtt_us": statistics.median(samples) * 1e6, "gbps": 2 * nbytes / best / 1e9}
    finally:
        if sock is not None:
            sock.close()
        server.stop()
        if agent is not None:
            if reg is not None:
                agent.deregister_memory(reg)
            if peer is not None:
                agent.remove_remote_agent(peer)


#: Why a backend has no raw library figure here (printed instead of a number).
NO_RAW = {
    "dpdk": "genie_dpdk's shim offers only its own reliable stream; a raw DPDK echo needs rte_eth_tx/rx_burst "
            "from C, which nothing here provides",
}


def run_raw_library(name: str, args: argparse.Namespace) -> dict[str, float] | str:
    """The backend's raw library figure measured now, or why there is none."""
    if name == "shm":
        return run_raw_shm(args)
    if name == "rdma":
        return run_raw_rdma(args)
    return NO_RAW.get(name, "no raw library figure for this backend")


def run_dpdk_af_packet(nbytes: int, loss: float = 0.05) -> dict[str, Any]:
    """``nbytes`` up and back down over af_packet between two fresh namespaces, ``loss`` dropped at both ends."""
    import json
    import uuid

    if os.geteuid() != 0:
        raise RuntimeError("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, dev_a, dev_b = f"genie-bench-{tag}-a", f"genie-bench-{tag}-b", f"gb{tag}a", f"gb{tag}b"

    def ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=20)

    made = []
    server = None
    try:
        for ns in (ns_a, ns_b):
            ip("netns", "add", ns)
            made.append(ns)
        ip("link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, dev_a, "10.232.0.1"), (ns_b, dev_b, "10.232.0.2")):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "mtu", "9000", "up")
        env = {**os.environ, "GENIE_DPDK_RX_LOSS": str(loss), "GENIE_DPDK_LOSS_SEED": "3"}
        peer = [sys.executable, "-m", "genie_dpdk.peer"]
        server = subprocess.Popen(["ip", "netns", "exec", ns_a, *peer, "serve", "10.232.0.1"], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**env, "GENIE_DPDK_IFACE": dev_a})
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"af_packet server did not start: {server.communicate(timeout=30)[1][-2000:]}")
        client = subprocess.run(["ip", "netns", "exec", ns_b, *peer, "client", "10.232.0.1", port, str(nbytes), "5"],
                                capture_output=True, text=True, timeout=300, env={**env, "GENIE_DPDK_IFACE": dev_b})
        if client.returncode != 0:
            raise RuntimeError(f"af_packet client failed: {client.stderr[-2000:]}")
        report: dict[str, Any] = json.loads(client.stdout.strip().splitlines()[-1])
        server.communicate(timeout=60)
        report["gbps"] = 2 * nbytes / report["seconds"] / 1e9
        return report
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.communicate()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


# -- tiny op + .item() through a real node -------------------------------------------------------

#: Backends a node is started with (those installed of these); each client asks for one with GENIE_BACKEND.
NODE_PLUGINS = ("tcp", "shm", "dpdk", "rdma")
OP_WARMUP = 50


def op_client(port: int, count: int) -> None:
    """Child: init against the node (GENIE_BACKEND from the environment), time ``(x + 1).item()``; JSON out."""
    import json

    import torch

    import genie

    genie.init_sync(master_addr="127.0.0.1", master_port=port, timeout=60)
    try:
        import genie.api as api

        assert api._runtime is not None
        conn = api._runtime.table.connections()[0]
        x = torch.ones(1, device="remote_accelerator:0")
        for _ in range(OP_WARMUP):
            value = (x + 1).item()
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            value = (x + 1).item()
            samples.append(time.perf_counter() - start)
        if value != 2.0:
            raise AssertionError(f"(ones(1) + 1).item() gave {value}")
        print("RESULT", json.dumps({"backend": conn.backend, "address": str(conn.address),
                                    "op_us": statistics.median(samples) * 1e6}), flush=True)
    finally:
        genie.shutdown_sync()


def run_ops(wanted: list[str], count: int) -> dict[str, dict[str, Any] | str]:
    """One node serving every installed backend of NODE_PLUGINS; per backend a client process timing a tiny op.

    Returns backend -> {"op_us", "address"} or the reason it could not run. The node is stopped
    on every path (NodeProcess is a context manager), a client is killed when it overruns.
    """
    import json
    from importlib.metadata import entry_points

    from genie.cluster.launch import NodeProcess

    plugins = ",".join(sorted({ep.name for ep in entry_points(group="genie")} & set(NODE_PLUGINS)))
    # the node runs the same genie as this script (the checkout it lives in), wherever it is started from
    root = str(Path(__file__).resolve().parents[1])
    env = {"GENIE_PLUGINS": plugins, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out: dict[str, dict[str, Any] | str] = {}
    with NodeProcess("serve", "--port", "0", "--devices", "cpu", env=env) as node:
        for name in wanted:
            try:
                proc = subprocess.run([sys.executable, __file__, "--op-client", str(node.control_port), str(count)],
                                      capture_output=True, text=True, timeout=300,
                                      env={**os.environ, **env, "GENIE_BACKEND": name})
            except subprocess.TimeoutExpired:
                out[name] = "the client did not finish in 300 s (killed)"
                continue
            lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                out[name] = f"client failed (exit {proc.returncode}): {tail[:300]}"
                continue
            result = json.loads(lines[-1])
            if result["backend"] != name:
                out[name] = f"error: asked for {name} but the session used {result['backend']}"
                continue
            out[name] = result
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rtts", type=int, default=2000)
    parser.add_argument("--ops", type=int, default=300, help="timed tiny ops per backend (after 50 warm-ups)")
    parser.add_argument("--backend", default="", help="comma-separated backends (default: every installed one)")
    parser.add_argument("--no-af-packet", action="store_true", help="skip dpdk's af_packet run with injected loss")
    parser.add_argument("--no-ops", action="store_true", help="skip the tiny op + .item() through a node")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--op-client", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.op_client:
        op_client(*args.op_client)
        return 0
    if args.serve:
        kind, *extra = args.serve
        if kind == "raw":
            serve_raw()
        elif kind == "raw-shm":
            serve_raw_shm(extra[0])
        elif kind == "raw-rdma":
            serve_raw_rdma(int(extra[0]))
        else:
            serve_backend(kind)
        return 0

    import signal

    # SIGTERM unwinds like Ctrl-C, so every finally runs: echo servers, the node and its clients are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from genie.plugins import PluginManager
    from genie.transport.base import ProbeOnlyTransport

    installed = sorted(PluginManager().transports())
    wanted = [n.strip() for n in args.backend.split(",") if n.strip()] or installed
    size = f"{args.mib} MiB up+down"
    raw = run_raw(args)
    print(f"{'backend':10} {'64 B rtt':>12} {'ratio':>7} {size:>18} {'ratio':>7}")
    print(f"{'raw tcp':10} {raw['rtt_us']:9.1f} us {1.0:6.2f}x {raw['gbps']:13.2f} GB/s {1.0:6.2f}x")
    failed = []
    measured: dict[str, dict[str, float]] = {}
    libs: dict[str, dict[str, float] | str] = {}
    for name in wanted:
        try:
            if name not in installed:
                raise RuntimeError(f"no installed plugin provides backend {name!r} (installed: {installed})")
            cls = PluginManager().transports()[name]
            if issubclass(cls, ProbeOnlyTransport):
                raise RuntimeError(cls.no_data_path)
            r = run_backend(name, args)
        except Exception as exc:
            print(f"{name:10} cannot run here: {type(exc).__name__}: {exc}")
            if args.backend:
                failed.append(name)
            continue
        measured[name] = r
        # rtt ratio: raw/backend (above 1: faster than raw TCP); bulk ratio: backend/raw.
        print(f"{name:10} {r['rtt_us']:9.1f} us {raw['rtt_us'] / r['rtt_us']:6.2f}x "
              f"{r['gbps']:13.2f} GB/s {r['gbps'] / raw['gbps']:6.2f}x   {r['channel']}")
        if name == "tcp":
            libs[name] = raw  # tcp's raw library is the raw TCP row
            continue
        try:  # right after the backend's own figure, so both see the same machine
            libs[name] = run_raw_library(name, args)
        except Exception as exc:
            libs[name] = f"raw figure failed: {type(exc).__name__}: {exc}"
            failed.append(f"{name} raw")
    if "dpdk" in wanted and "dpdk" in installed and not args.no_af_packet:
        try:
            lossy = run_dpdk_af_packet(args.mib << 20)
            stats = lossy["stats"]
            print(f"{'dpdk af_packet, 5 % loss':24} {lossy['gbps']:8.2f} GB/s {lossy['gbps'] / raw['gbps']:6.2f}x  "
                  "every byte "
                  f"right; {stats['injected_drops']} frames dropped, {stats['retransmits']} retransmitted")
        except Exception as exc:
            print(f"dpdk af_packet with loss cannot run here: {type(exc).__name__}: {exc}")
            if args.backend:
                failed.append("dpdk af_packet")

    print()
    print("genie channel against the same backend's raw library, measured in this run (ratio: genie / raw)")
    print(f"{'backend':10} {'64 B rtt':>12} {'raw lib':>12} {'ratio':>7} {size:>18} {'raw lib':>13} {'ratio':>7}")
    for name, r in measured.items():
        lib = libs.get(name, "not measured")
        if isinstance(lib, str):
            print(f"{name:10} {r['rtt_us']:9.1f} us {'-':>12} {'-':>7} {r['gbps']:13.2f} GB/s {'-':>13} {'-':>7}"
                  f"   raw: not measured ({lib})")
            continue
        label = "  (raw lib: raw tcp)" if name == "tcp" else ""
        print(f"{name:10} {r['rtt_us']:9.1f} us {lib['rtt_us']:9.1f} us {r['rtt_us'] / lib['rtt_us']:6.2f}x "
              f"{r['gbps']:13.2f} GB/s {lib['gbps']:8.2f} GB/s {r['gbps'] / lib['gbps']:6.2f}x{label}")

    if not args.no_ops:
        print()
        print(f"tiny op through a node: (x + 1).item() on remote_accelerator:0, median of {args.ops} "
              f"after {OP_WARMUP} warm-ups (ratio: op / raw tcp 64 B rtt)")
        print(f"{'backend':10} {'op + item':>12} {'ratio':>7}")
        try:
            ops = run_ops(list(measured), args.ops)
        except Exception as exc:
            print(f"{'all':10} the node did not start: {type(exc).__name__}: {exc}")
            failed.append("ops")
            ops = {}
        for name, o in ops.items():
            if isinstance(o, str):
                print(f"{name:10} cannot run here: {o}")
                if args.backend or o.startswith("error"):
                    failed.append(f"{name} op")
                continue
            print(f"{name:10} {o['op_us']:9.1f} us {o['op_us'] / raw['rtt_us']:6.2f}x   session {name} "
                  f"to {o['address']}")

    print()
    print("ratios vs raw TCP: above 1.00x is better than raw TCP (round trip: raw/backend time; bulk: "
          "backend/raw rate)")
    print("ratios vs raw library: genie / raw (round trip: time, above 1.00x is genie's overhead over the "
          "floor; bulk: rate, below 1.00x is how far genie stays under it)")
    if "shm" in libs:
        print("shm raw: the whole buffer is copied in before the far end copies it out; genie's ring overlaps "
              "writer and reader, so its bulk can pass this floor")
    if "rdma" in libs:
        from genie_rdma.nixl_path import BULK_MIN

        print(f"rdma: genie sends buffers under {BULK_MIN >> 10} KiB inline on its TCP stream, so its 64 B round "
              "trip is TCP; the raw one is two NIXL READs + notifications")
    if not args.no_ops:
        print("tiny op: client -> node -> client through the whole stack (op record, execution, .item()'s "
              "answer); its ratio counts raw TCP 64 B round trips")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
