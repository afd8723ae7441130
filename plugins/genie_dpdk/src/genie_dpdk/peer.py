"""One end of a DPDK channel in its own process (run by the data-path tests and benchmarks/bench_backends.py).

    python -m genie_dpdk.peer serve HOST                prints the port, then echoes each transfer back
    python -m genie_dpdk.peer client HOST PORT N SEED   sends N seeded bytes, checks the echo, prints a JSON report

Each transfer is an 8-byte length then the bytes; the server echoes them back whole and
the client compares every byte. A zero length ends the session. The DPDK port comes
from the environment (GENIE_DPDK_IFACE: af_packet; unset: memif), as does injected
loss (GENIE_DPDK_RX_LOSS, GENIE_DPDK_LOSS_SEED).
"""

from __future__ import annotations

import json
import os
import random
import struct
import sys
import time
from typing import Any

from genie.transport.base import handshake_complete
from genie_dpdk import engine
from genie_dpdk.transport import DpdkTransport

LENGTH = struct.Struct("<Q")


def recv_exact(channel: Any, n: int) -> bytearray:
    buf = bytearray(n)
    channel.recv_into(memoryview(buf))
    return buf


def serve(host: str) -> None:
    listener = DpdkTransport().listen(host, 0)
    print(listener.port, flush=True)
    channel = listener.accept(timeout=60)
    channel.settimeout(float(os.environ.get("PEER_TIMEOUT", "60")))
    try:
        while True:
            (n,) = LENGTH.unpack(recv_exact(channel, LENGTH.size))
            if not n:
                break
            channel.sendv([recv_exact(channel, n)])
        print(json.dumps({"served": repr(channel), "stats": channel.stats()}), flush=True)
    except BaseException:
        print(f"server failed; DPDK stream counters: {channel.stats()}", file=sys.stderr, flush=True)
        raise
    finally:
        channel.close()
        listener.close()
    assert not engine.engine_running(), "the polling thread outlived the last channel"


def client(host: str, port: int, nbytes: int, seed: int, rounds: int = 1) -> None:
    channel = DpdkTransport().connect(host, port, timeout=30)
    channel.settimeout(float(os.environ.get("PEER_TIMEOUT", "60")))
    try:
        handshake_complete(channel, {})
        data = random.Random(seed).randbytes(nbytes)
        started = time.perf_counter()
        for _ in range(rounds):
            channel.sendv([LENGTH.pack(nbytes), data])
            back = recv_exact(channel, nbytes)
            if back != data:
                wrong = next(i for i in range(nbytes) if back[i] != data[i])
                raise AssertionError(f"byte {wrong} of {nbytes} differs")
        elapsed = time.perf_counter() - started
        channel.sendv([LENGTH.pack(0)])
        report = {"ok": True, "channel": repr(channel), "seconds": elapsed, "stats": channel.stats()}
    except BaseException:
        print(f"client failed; DPDK stream counters: {channel.stats()}", file=sys.stderr, flush=True)
        raise
    finally:
        channel.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
               int(sys.argv[6]) if len(sys.argv) > 6 else 1)
