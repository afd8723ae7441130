"""The ``shm`` transport: same-host shared memory, chosen over every network when the peer is local.

Its listener is a TCP listener that serves both kinds of client: a peer that
opens with the shm preamble (``GSHM``, version, boot id, network namespace) gets
an :class:`~genie_shm.channel.ShmChannel` when its identity equals ours (one
kernel, one network namespace) and a refusal naming the difference otherwise;
any other peer (plain genie over TCP, TLS) gets a plain
:class:`~genie_tcp.TcpChannel`. So a node that selects shm still serves remote
clients, which connect with ``tcp``.

The listener waits for each peer's preamble without a thread (one selector, within
``PREAMBLE_TIMEOUT`` of the accept, after the pre-authentication caps; see
:class:`genie_tcp.sniff.SniffingListener`): a peer that connects and says nothing
cannot stall it nor cost a thread. Shared memory is offered only after the
session's WELCOME (:meth:`~genie.transport.record.RecordChannel.allow_upgrade`).
"""

from __future__ import annotations

import logging
import struct
from typing import Any

from genie.errors import BackendUnavailableError
from genie.security import REFUSALS
from genie.transport.base import ProbeTarget, Transport
from genie.transport.sniff import SniffingListener, answer_preamble, connect_with_preamble
from genie.transport.stream import TcpChannel
from genie.types import Figure, ProbeResult
from genie_shm.channel import ShmChannel
from genie_shm.host import host_identity, is_local_address
from genie_shm.ring import ring_bytes_from_env

log = logging.getLogger("genie.transport.shm")

PREAMBLE = struct.Struct("<4sB16sQ")
MAGIC = b"GSHM"
VERSION = 1
#: How long an accepted connection has to say what it is.
PREAMBLE_TIMEOUT = 10.0

#: This backend's rank among backends (higher wins; tcp 100, dpdk 200, rdma 300, dpdk_gpudev 400, shm 500):
#: shared memory between processes on one host beats any network (its probe refuses other hosts).
PRIORITY_SHM = 500


class ShmListener(SniffingListener):
    """Accepts shm peers on one host and plain TCP peers from anywhere; see the module docstring."""

    def __init__(self, host: str, port: int, ring_bytes: int) -> None:
        self._ring_bytes = ring_bytes
        super().__init__(host, port, MAGIC, self._greet_shm, greet_timeout=PREAMBLE_TIMEOUT, name="shm",
                         preamble_bytes=PREAMBLE.size)

    def _greet_shm(self, tcp: TcpChannel) -> ShmChannel | None:
        """Read the shm preamble, check the peer shares our kernel and network namespace, answer."""
        raw = bytearray(PREAMBLE.size)
        tcp.recv_into(memoryview(raw))
        _, version, boot, netns = PREAMBLE.unpack(raw)
        reason = _refusal(version, boot, netns)
        answer_preamble(tcp, reason)
        if reason:
            REFUSALS.warning("refused shm peer %s: %s", tcp.peer, reason)
            return None
        return ShmChannel(tcp, server_side=True, ring_bytes=self._ring_bytes)


def _refusal(version: int, boot: bytes, netns: int) -> str:
    """Why a peer with this identity cannot share memory with us ("" when it can)."""
    if version != VERSION:
        return f"shm protocol version {version} is not supported (this node speaks {VERSION})"
    my_boot, my_netns = host_identity()
    if boot != my_boot:
        return "the peer runs under another kernel (boot id differs): it is on another host"
    if netns != my_netns:
        return "the peer is in another network namespace: shm's hand-over sockets cannot reach it"
    return ""


class ShmTransport(Transport):
    """Shared-memory rings between two processes on one host; refused across hosts."""

    name = "shm"
    default_priority = PRIORITY_SHM

    DECLARED = {
        "host_copies": Figure(2, "copies", measured=False),  # into the ring, out of the ring; no kernel
        "gpu_direct": Figure(0, "bool", measured=False),
    }

    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """Available when the peer's address is one of this host's (or, without a peer, on Linux with memfd)."""
        import os

        declared: dict[str, Any] = dict(self.DECLARED)
        if not hasattr(os, "memfd_create"):
            return ProbeResult(self.name, False, "unsupported", "memfd_create is not available on this platform",
                               self.default_priority, declared)
        if not target.host:
            return ProbeResult(self.name, True, "ok", "local capabilities only (peers on this host)",
                               self.default_priority, declared, details={"same_host_only": True})
        local, why = is_local_address(target.host)
        if not local:
            return ProbeResult(self.name, False, "not_same_host", why, self.default_priority, declared,
                               details={"same_host_only": True})
        figures, cached = await self.run_measurement(target)
        return ProbeResult(self.name, True, "ok", f"{target.host} is on this host", self.default_priority,
                           {**declared, **figures}, details={"same_host_only": True, "figures_cached": cached,
                                                             "measured_on": "a loopback pair on this host"})

    async def run_measurement(self, target: ProbeTarget) -> tuple[dict[str, Figure], bool]:
        """Bandwidth and latency of shm on this host (the peer's host), cached per host pair; bounded."""
        import anyio.to_thread

        from genie.transport.measure import measured_figures

        def opener() -> tuple[Any, Any, Any]:
            listener = self.listen("127.0.0.1", 0)
            try:
                client = self.connect("127.0.0.1", listener.port, timeout=2.0)
                server = listener.accept(timeout=2.0)
            except BaseException:
                listener.close()
                raise
            return client, server, listener.close

        budget = max(0.2, min(1.5, target.timeout * 0.6))
        return await anyio.to_thread.run_sync(
            lambda: measured_figures(self.name, "this host", opener, budget=budget), abandon_on_cancel=True)

    def connect(self, host: str, port: int, *, timeout: float) -> ShmChannel:
        """Open TCP to a local listener and agree on shared memory; BackendUnavailableError across hosts."""
        local, why = is_local_address(host)
        if not local:
            raise BackendUnavailableError(f"shm cannot reach {host}:{port}: {why}")
        ring_bytes = ring_bytes_from_env()
        boot, netns = host_identity()
        tcp = connect_with_preamble(host, port, PREAMBLE.pack(MAGIC, VERSION, boot, netns), timeout=timeout,
                                    backend="shm")
        log.debug("shm channel to %s:%d (segments follow the handshake)", host, port)
        return ShmChannel(tcp, server_side=False, ring_bytes=ring_bytes)

    def listen(self, host: str, port: int) -> ShmListener:
        """Listen on ``host:port`` for shm peers (this host) and plain TCP peers (anywhere)."""
        return ShmListener(host, port, ring_bytes_from_env())
