"""The ``dpdk`` transport: a real EAL probe; the data path is not in this release."""

from __future__ import annotations

from genie.transport.base import PRIORITY_DPDK, ProbeOnlyTransport, ProbeTarget
from genie.types import Figure, ProbeResult
from genie_dpdk import eal

INSTALL_HINT = (
    "install dpdk (Debian: apt install dpdk), or point GENIE_DPDK_LIB_DIR at the directory "
    f"holding librte_eal.so.{eal.ABI}"
)
NO_DATA_PATH = (
    "the DPDK data path is not implemented in genie-dpdk 0.1.0: this release probes DPDK for real "
    "but cannot move frames yet; use backend=auto (genie then uses another backend) or name another backend"
)
#: Port names of DPDK's virtual devices (the probe's own net_null0 is one).
VIRTUAL_PREFIXES = ("net_null", "net_memif", "net_ring", "net_tap", "net_pcap", "net_af_packet")


def declared_figures() -> dict[str, Figure]:
    """Typical figures of DPDK on a 100 GbE NIC, as the plugin declares them (nothing here measures them)."""
    return {
        "bandwidth": Figure(100.0, "Gbit/s", measured=False),
        "latency": Figure(10.0, "us", measured=False),
        "zero_copy": Figure(1.0, "bool", measured=False),
    }


def result_from_report(report: eal.EalReport, name: str = "dpdk", priority: int = PRIORITY_DPDK) -> ProbeResult:
    """Turn an EAL report into the ``dpdk`` probe result."""
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
    details["data_path"] = False
    details["data_path_note"] = NO_DATA_PATH
    if not report.ports:
        return ProbeResult(name, False, "no_ports", "EAL started but no Ethernet port is available "
                           "(check GENIE_DPDK_EAL_ARGS and that the NIC is bound to a DPDK driver)",
                           priority=priority, details=details)
    virtual = all(p.startswith(VIRTUAL_PREFIXES) for p in report.ports)
    details["virtual_ports_only"] = virtual
    kind = "virtual" if virtual else "including physical"
    return ProbeResult(
        name, True, "ok",
        f"{report.version or 'DPDK'}: EAL started, {len(report.ports)} port(s) ({', '.join(report.ports)}; {kind})",
        priority=priority, figures=declared_figures(), details=details,
    )


class DpdkTransport(ProbeOnlyTransport):
    """DPDK (user-space Ethernet). Probe: start an EAL in a subprocess and count ports."""

    name = "dpdk"
    no_data_path = NO_DATA_PATH
    default_priority = PRIORITY_DPDK

    @classmethod
    def host_fingerprint(cls) -> dict[str, object]:
        """Library files, driver directory and EAL arguments (see :func:`genie_dpdk.eal.host_fingerprint`)."""
        return eal.host_fingerprint()

    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """Start an EAL (shared with dpdk_gpudev's probe) and report library, EAL and port state."""
        report = await self.run_blocking_probe(eal.eal_report, target)
        return result_from_report(report, self.name, self.default_priority)

