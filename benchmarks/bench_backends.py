"""Every data-plane backend that works here against raw TCP, measured in one run: ratios.

    python benchmarks/bench_backends.py [--mib 64] [--repeat 5] [--rtts 2000] [--backend shm,tcp]

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
For ``dpdk`` it also prints the DPDK stream's counters (retransmits: zero on memif means
no frame was lost), and, as root, moves ``--mib`` MiB both ways over ``net_af_packet``
between two network namespaces joined by a veth pair (MTU 9000) with 5 % of received
frames dropped (seeded) at both ends, checking every byte (``--no-af-packet`` skips it).
A backend named in ``--backend`` that cannot work here is reported with its reason
and makes the run exit 1 (never a silent skip); without ``--backend`` every
installed backend is tried and the ones that cannot work are listed with why.
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


# -- clients -------------------------------------------------------------------------------------

class Server:
    """A child echo server; stopped (killed if need be) on exit."""

    def __init__(self, kind: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rtts", type=int, default=2000)
    parser.add_argument("--backend", default="", help="comma-separated backends (default: every installed one)")
    parser.add_argument("--no-af-packet", action="store_true", help="skip dpdk's af_packet run with injected loss")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "raw":
        serve_raw()
        return 0
    if args.serve:
        serve_backend(args.serve)
        return 0

    from genie.plugins import PluginManager

    installed = sorted(PluginManager().transports())
    wanted = [n.strip() for n in args.backend.split(",") if n.strip()] or installed
    raw = run_raw(args)
    print(f"{'backend':10} {'64 B rtt':>12} {'ratio':>7} {f'{args.mib} MiB up+down':>18} {'ratio':>7}")
    print(f"{'raw tcp':10} {raw['rtt_us']:9.1f} us {1.0:6.2f}x {raw['gbps']:13.2f} GB/s {1.0:6.2f}x")
    failed = []
    for name in wanted:
        try:
            if name not in installed:
                raise RuntimeError(f"no installed plugin provides backend {name!r} (installed: {installed})")
            from genie.transport.base import ProbeOnlyTransport

            cls = PluginManager().transports()[name]
            if issubclass(cls, ProbeOnlyTransport):
                raise RuntimeError(cls.no_data_path)
            r = run_backend(name, args)
        except Exception as exc:
            print(f"{name:10} cannot run here: {type(exc).__name__}: {exc}")
            if args.backend:
                failed.append(name)
            continue
        # rtt ratio: raw/backend (above 1: faster than raw TCP); bulk ratio: backend/raw.
        print(f"{name:10} {r['rtt_us']:9.1f} us {raw['rtt_us'] / r['rtt_us']:6.2f}x "
              f"{r['gbps']:13.2f} GB/s {r['gbps'] / raw['gbps']:6.2f}x   {r['channel']}")
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
    print("ratios: above 1.00x is better than raw TCP (round trip: raw/backend time; bulk: backend/raw rate)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
