"""The TCP transport: the core's stream channel (:mod:`genie.transport.stream`), probed with anyio.

The channel and listener, and the translation of every socket failure into genie's errors, live in
the core (shm, rdma and dpdk use the same channel for their control streams); this module is the
transport: its probe (a measured connect round trip), ``connect`` and ``listen``.
"""

from __future__ import annotations

import logging
import statistics
import time

import anyio

from genie.transport.base import ProbeTarget, Transport
from genie.transport.stream import TcpChannel, TcpListener, connect_stream, describe_address
from genie.types import Figure, ProbeResult

__all__ = ["PRIORITY_TCP", "TcpChannel", "TcpListener", "TcpTransport"]

log = logging.getLogger("genie.transport.tcp")

#: TCP's rank among backends: the data plane of last resort (shm 500, dpdk_gpudev 400, rdma 300, dpdk 200).
PRIORITY_TCP = 100
#: Connect samples the probe takes to measure the round trip.
_PROBE_SAMPLES = 3


class TcpTransport(Transport):
    """Plain TCP through the kernel: always available, two host copies per transfer."""

    name = "tcp"
    default_priority = PRIORITY_TCP

    #: What this transport declares about itself (not measured).
    DECLARED = {
        "host_copies": Figure(2, "copies", measured=False),  # user->kernel on send, kernel->user on receive
        "gpu_direct": Figure(0, "bool", measured=False),
    }

    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """Measure the connect round trip to ``target`` (median of a few), or report local capabilities."""
        declared = dict(self.DECLARED)
        if not target.host:
            return ProbeResult(
                self.name, True, "ok", "local capabilities only", self.default_priority, declared
            )
        where = describe_address(target.host, target.port)
        samples: list[float] = []
        try:
            with anyio.fail_after(target.timeout):
                for _ in range(_PROBE_SAMPLES):
                    start = time.perf_counter()
                    stream = await anyio.connect_tcp(target.host, target.port)
                    samples.append((time.perf_counter() - start) * 1e6)
                    await stream.aclose()
        except TimeoutError:
            if not samples:
                return ProbeResult(
                    self.name, False, "timeout",
                    f"no TCP connection to {where} within {target.timeout:g} s", self.default_priority, declared,
                )
        except OSError as exc:
            if not samples:
                return ProbeResult(
                    self.name, False, "unreachable",
                    f"cannot connect to {where}: {exc}", self.default_priority, declared,
                    details={"errno": exc.errno, "error": str(exc)},
                )
        figures = {"rtt": Figure(round(statistics.median(samples), 1), "us", measured=True), **declared}
        return ProbeResult(
            self.name, True, "ok", f"connected to {where}", self.default_priority, figures,
            details={"samples": len(samples)},
        )

    def connect(self, host: str, port: int, *, timeout: float) -> TcpChannel:
        """Open a channel to ``host:port``; ConnectError naming the peer and the OS error when that fails."""
        channel = connect_stream(host, port, timeout=timeout)
        log.debug("connected to %s", channel.peer)
        return channel

    def listen(self, host: str, port: int) -> TcpListener:
        """Listen on ``host:port`` (port 0: any free port; ``.port`` tells which)."""
        listener = TcpListener(host, port)
        log.debug("listening on %s", describe_address(listener.host, listener.port))
        return listener
