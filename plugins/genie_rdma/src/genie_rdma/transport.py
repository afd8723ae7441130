"""The ``rdma`` transport: a verbs probe through pyverbs, the data path on NIXL (see genie_rdma.nixl_path).

When is it available?

- RDMA devices with an ACTIVE port (verbs probe) and NIXL installed: yes, over
  verbs (RDMA; GPUDirect RDMA for CUDA regions). Hardware only: no CI here.
- No RDMA device, NIXL installed and ``UCX_TLS`` set (``tcp``, ``shm,self``...):
  yes, over those UCX transports: the user asked for UCX explicitly. This is how
  the data path is tested on machines without an RDMA NIC.
- Otherwise no, with the reason (no devices; NIXL missing, with the install line).

Its listener serves rdma peers (preamble ``GRDM``) and plain TCP peers alike
(:class:`genie_tcp.sniff.SniffingListener`), so a node that selects rdma still
serves clients without it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import struct
from typing import Any

from genie.errors import BackendUnavailableError
from genie.transport.base import ProbeOnlyTransport, ProbeTarget, Transport
from genie.transport.sniff import SniffingListener, answer_preamble, connect_with_preamble
from genie.transport.stream import TcpChannel
from genie.types import Figure, ProbeResult
from genie_rdma import verbs
from genie_rdma.nixl_path import INSTALL_HINT, Agent, RdmaChannel

log = logging.getLogger("genie.transport.rdma")

INSTALL_PYVERBS = "install python3-pyverbs and rdma-core (Debian: apt install python3-pyverbs rdma-core)"
MAGIC = b"GRDM"
PREAMBLE = struct.Struct("<4sB")
VERSION = 1

#: This backend's rank among backends (higher wins; tcp 100, dpdk 200, rdma 300, dpdk_gpudev 400, shm 500):
#: kernel bypass with one-sided writes: above dpdk, below shm and dpdk_gpudev.
PRIORITY_RDMA = 300


def declared_figures() -> dict[str, Figure]:
    """Typical figures of RDMA on a 100 Gbit/s HCA, as declared by this plugin (not measured)."""
    return {
        "bandwidth": Figure(100.0, "Gbit/s", measured=False),
        "latency": Figure(2.0, "us", measured=False),
        "zero_copy": Figure(1.0, "bool", measured=False),
    }


def nixl_installed() -> bool:
    """Whether NIXL can be imported (checked without importing it: that loads UCX)."""
    return importlib.util.find_spec("nixl_cu12") is not None


def result_from_report(report: verbs.VerbsReport, name: str = "rdma", priority: int = PRIORITY_RDMA,
                       *, nixl: bool | None = None, ucx_tls: str | None = None) -> ProbeResult:
    """Turn a verbs report (and whether NIXL is here, and ``UCX_TLS``) into the ``rdma`` probe result."""
    nixl = nixl_installed() if nixl is None else nixl
    ucx_tls = os.environ.get("UCX_TLS", "") if ucx_tls is None else ucx_tls
    details: dict[str, Any] = {"stage": report.stage, "pyverbs": report.pyverbs, "interpreter": report.interpreter,
                               "nixl": nixl}
    if not nixl:
        details["data_path"] = False
        details["data_path_note"] = f"NIXL is not installed: {INSTALL_HINT}"
    active = [f"{d['name']}:{p['port']}" for d in report.devices for p in d.get("ports", ()) if p.get("active")]
    if report.devices:
        details["devices"] = list(report.devices)
    if active:
        return ProbeResult(name, True, "ok", f"{len(active)} active port(s): {', '.join(active)}",
                           priority=priority, figures=declared_figures(), details=details)
    if nixl and ucx_tls:
        details["ucx_tls"] = ucx_tls
        return ProbeResult(name, True, "ok", f"no RDMA device; NIXL over UCX_TLS={ucx_tls} (set by you)",
                           priority=priority, details=details)
    if report.stage in ("missing", "import"):
        return ProbeResult(name, False, "library_missing", f"pyverbs not found: {INSTALL_PYVERBS} ({report.error})",
                           priority=priority, details=details)
    if report.stage == "timeout":
        return ProbeResult(name, False, "timeout", report.error, priority=priority, details=details)
    if report.stage == "crash":
        return ProbeResult(name, False, "error", report.error, priority=priority, details=details)
    if report.devices:
        names = ", ".join(d["name"] for d in report.devices)
        return ProbeResult(name, False, "no_active_ports", f"RDMA devices ({names}) have no ACTIVE port",
                           priority=priority, details=details)
    why = f" ({report.error})" if report.error else ""
    hint = "; or set UCX_TLS (tcp, shm) to run NIXL over UCX without one" if nixl else ""
    return ProbeResult(name, False, "no_devices", f"no RDMA devices: ibv_get_device_list found none{why}; "
                       f"an RDMA NIC (or rxe/siw soft-RoCE) is needed{hint}", priority=priority, details=details)


def _greet(tcp: TcpChannel) -> RdmaChannel | None:
    raw = bytearray(PREAMBLE.size)
    tcp.recv_into(memoryview(raw))
    _, version = PREAMBLE.unpack(raw)
    agent: Agent | None = None
    reason = "" if version == VERSION else f"rdma protocol version {version} is not supported (this node: {VERSION})"
    if not reason:
        try:
            agent = Agent()
        except BackendUnavailableError as exc:
            reason = str(exc)
    answer_preamble(tcp, reason)
    if agent is None:
        log.warning("refused rdma peer %s: %s", tcp.peer, reason)
        return None
    return RdmaChannel(tcp, agent, server_side=True)


class RdmaTransport(Transport):
    """RDMA through NIXL (UCX: verbs, GPUDirect RDMA; tcp and shared memory where UCX_TLS says so)."""

    name = "rdma"
    default_priority = PRIORITY_RDMA

    @classmethod
    def host_fingerprint(cls) -> dict[str, Any]:
        """See :func:`genie_rdma.verbs.host_fingerprint`; plus NIXL's presence and UCX_TLS."""
        return {**verbs.host_fingerprint(), "nixl": nixl_installed(), "ucx_tls": os.environ.get("UCX_TLS", "")}

    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """Run the verbs probe in a subprocess; report devices, ports, GIDs and whether NIXL can carry data."""
        report = await ProbeOnlyTransport.run_blocking_probe(verbs.verbs_report, target)
        return result_from_report(report, self.name, self.default_priority)

    def connect(self, host: str, port: int, *, timeout: float) -> RdmaChannel:
        """TCP for control, then a NIXL agent; metadata is exchanged after the handshake."""
        agent = Agent()  # BackendUnavailableError naming the fix when NIXL is missing
        tcp = connect_with_preamble(host, port, PREAMBLE.pack(MAGIC, VERSION), timeout=timeout, backend="rdma")
        return RdmaChannel(tcp, agent, server_side=False)

    def listen(self, host: str, port: int) -> SniffingListener:
        """Listen on ``host:port`` for rdma peers and plain TCP peers."""
        return SniffingListener(host, port, MAGIC, _greet, name="rdma")
