"""The ``dpdk`` transport: a real EAL probe and a reliable data path over memif or af_packet.

Its listener serves dpdk peers (preamble ``GDPD``) and plain TCP peers alike
(:class:`genie_tcp.sniff.SniffingListener`). Which DPDK port a channel uses:

- ``GENIE_DPDK_IFACE`` unset: ``net_memif`` between two processes on one host
  (shared-memory rings driven by DPDK); ``connect`` refuses other hosts at once;
- ``GENIE_DPDK_IFACE=<interface>`` on both ends: ``net_af_packet`` on that
  interface (a veth pair between network namespaces here; a real NIC's PMD on
  hardware), jumbo frames when the interface's MTU allows.

See :mod:`genie_dpdk.channel` for the protocol and :mod:`genie_dpdk.engine` for the
EAL and the polling thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from typing import Any

from genie.errors import BackendUnavailableError
from genie.transport.base import ProbeOnlyTransport, ProbeTarget, Transport
from genie.transport.sniff import SniffingListener, answer_preamble, connect_with_preamble
from genie.transport.stream import TcpChannel
from genie.types import Figure, ProbeResult
from genie_dpdk import eal, engine
from genie_dpdk.channel import DpdkChannel, interface

log = logging.getLogger("genie.transport.dpdk")

MAGIC = b"GDPD"
PREAMBLE = struct.Struct("<4sB")
VERSION = 1

INSTALL_HINT = (
    "install dpdk (Debian: apt install dpdk), or point GENIE_DPDK_LIB_DIR at the directory "
    f"holding librte_eal.so.{eal.ABI}"
)
#: Port names of DPDK's virtual devices (the probe's own net_null0 is one).
VIRTUAL_PREFIXES = ("net_null", "net_memif", "net_ring", "net_tap", "net_pcap", "net_af_packet")

#: This backend's rank among backends (higher wins; tcp 100, dpdk 200, rdma 300, dpdk_gpudev 400, shm 500):
#: kernel-bypass packets: above tcp, below rdma.
PRIORITY_DPDK = 200


def declared_figures() -> dict[str, Figure]:
    """Typical figures of DPDK on a 100 GbE NIC, as the plugin declares them (nothing here measures them)."""
    return {
        "bandwidth": Figure(100.0, "Gbit/s", measured=False),
        "latency": Figure(10.0, "us", measured=False),
        "zero_copy": Figure(1.0, "bool", measured=False),
    }


def result_from_report(report: eal.EalReport, name: str = "dpdk", priority: int = PRIORITY_DPDK,
                       *, shim: bool | None = None) -> ProbeResult:
    """Turn an EAL report (and whether the data path's shim was built) into the ``dpdk`` probe result."""
    details: dict[str, object] = {
        "stage": report.stage, "libs": report.libs, "probe_ms": report.elapsed_ms,
    }
    if report.version:
        details["dpdk_version"] = report.version
    if report.log:
        details["eal_log"] = report.log
    if report.stage in ("missing", "import", "load"):
        what = report.error or "not found"
        return ProbeResult(name, False, "library_missing", f"DPDK library not found: {INSTALL_HINT} ({what})",
                           priority=priority, details=details)
    if report.stage == "timeout":
        return ProbeResult(name, False, "timeout", report.error, priority=priority, details=details)
    if report.stage in ("eal_init", "crash"):
        errno = f" (rte_errno {report.errno})" if report.errno is not None else ""
        said = f"; DPDK said: {report.log}" if report.log else ""
        return ProbeResult(name, False, "eal_init_failed",
                           f"rte_eal_init failed: {report.error}{errno}{said}", priority=priority, details=details)
    details["ports"] = list(report.ports)
    details["eal_init_ms"] = report.eal_init_ms
    shim = engine.shim_built() if shim is None else shim
    details["data_path"] = shim
    details["port_kind"] = f"af_packet on {interface()}" if interface() else "memif (this host only)"
    if not shim:
        details["data_path_note"] = engine.NO_SHIM
        return ProbeResult(name, False, "library_missing", f"{engine.NO_SHIM} (the EAL itself started: "
                           f"{report.version or 'DPDK'}, ports {', '.join(report.ports) or 'none'})",
                           priority=priority, details=details)
    problem = data_port_problem(report.libs)
    if problem:
        details["data_path_note"] = problem[1]
        return ProbeResult(name, False, problem[0], problem[1], priority=priority, details=details)
    if not report.ports:
        return ProbeResult(name, False, "no_ports", "EAL started but no Ethernet port is available "
                           "(check GENIE_DPDK_EAL_ARGS and that the NIC is bound to a DPDK driver)",
                           priority=priority, details=details)
    virtual = all(p.startswith(VIRTUAL_PREFIXES) for p in report.ports)
    details["virtual_ports_only"] = virtual
    kind = "virtual" if virtual else "including physical"
    return ProbeResult(
        name, True, "ok",
        f"{report.version or 'DPDK'}: EAL started, {len(report.ports)} port(s) ({', '.join(report.ports)}; {kind}); "
        f"data path: {details['port_kind']}",
        priority=priority, figures=declared_figures(), details=details,
    )


def data_port_problem(libs: dict[str, str | None]) -> tuple[str, str] | None:
    """(reason code, text) when the data path's port cannot open here: its driver or interface missing."""
    import os

    from genie_dpdk.channel import interface_mtu

    iface = interface()
    driver, package = ("net_af_packet", "librte-net-af-packet23") if iface else ("net_memif", "librte-net-memif23")
    dirs = [d for d in eal.pmd_dirs(libs) if os.path.isdir(d)]
    if dirs and not any(f.startswith(f"librte_{driver}.so") for d in dirs for f in os.listdir(d)):
        return "library_missing", f"DPDK's {driver} driver is not installed (apt install {package})"
    if iface:
        try:
            interface_mtu(iface)
        except BackendUnavailableError as exc:
            return "no_ports", str(exc)
    return None


def _greet(tcp: TcpChannel) -> DpdkChannel | None:
    raw = bytearray(PREAMBLE.size)
    tcp.recv_into(memoryview(raw))
    _, version = PREAMBLE.unpack(raw)
    reason = "" if version == VERSION else f"dpdk protocol version {version} is not supported (this node: {VERSION})"
    if not reason:
        try:
            engine.load_shim()
        except BackendUnavailableError as exc:
            reason = str(exc)
    answer_preamble(tcp, reason)
    if reason:
        log.warning("refused dpdk peer %s: %s", tcp.peer, reason)
        return None
    return DpdkChannel(tcp, server_side=True)


def _is_local(host: str) -> bool:
    """Whether ``host`` is an address of this host (a socket binds only to the host's own addresses)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address[0], 0))
            return True
    return False


class DpdkTransport(Transport):
    """DPDK (user-space Ethernet). Probe: start an EAL in a subprocess and count ports; data: memif or af_packet."""

    name = "dpdk"
    default_priority = PRIORITY_DPDK

    @classmethod
    def host_fingerprint(cls) -> dict[str, Any]:
        """Library files, driver directory and EAL arguments (see :func:`genie_dpdk.eal.host_fingerprint`),
        whether the shim is built, and the interface af_packet would use."""
        return {**eal.host_fingerprint(), "shim": engine.shim_built(), "iface": interface()}

    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """Start an EAL (shared with dpdk_gpudev's probe) and report library, EAL, port and data-path state."""
        report = await ProbeOnlyTransport.run_blocking_probe(eal.eal_report, target)
        return result_from_report(report, self.name, self.default_priority)

    def connect(self, host: str, port: int, *, timeout: float) -> DpdkChannel:
        """TCP for control now; the DPDK port follows the handshake (:meth:`DpdkChannel.handshake_complete`)."""
        engine.load_shim()  # BackendUnavailableError naming the fix when the shim was not built
        if not interface() and not _is_local(host):
            raise BackendUnavailableError(f"dpdk cannot reach {host}:{port}: without GENIE_DPDK_IFACE it uses memif, "
                                          "which works only between processes on one host; set GENIE_DPDK_IFACE "
                                          "to the interface facing the peer (af_packet) on both ends")
        tcp = connect_with_preamble(host, port, PREAMBLE.pack(MAGIC, VERSION), timeout=timeout, backend="dpdk")
        return DpdkChannel(tcp, server_side=False)

    def listen(self, host: str, port: int) -> SniffingListener:
        """Listen on ``host:port`` for dpdk peers and plain TCP peers."""
        return SniffingListener(host, port, MAGIC, _greet, name="dpdk")
