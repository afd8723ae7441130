"""The ``rdma`` transport: a real verbs probe through pyverbs; the data path is not in this release."""

from __future__ import annotations

from typing import Any

from genie.transport.base import PRIORITY_RDMA, ProbeOnlyTransport, ProbeTarget
from genie.types import Figure, ProbeResult
from genie_rdma import verbs

INSTALL_HINT = "install python3-pyverbs and rdma-core (Debian: apt install python3-pyverbs rdma-core)"
NO_DATA_PATH = (
    "the RDMA data path is not implemented in genie-rdma 0.1.0: this release probes verbs devices for real "
    "but cannot move frames yet; use backend=auto or name another backend"
)


def declared_figures() -> dict[str, Figure]:
    """Typical figures of RDMA on a 100 Gbit/s HCA, as declared by this plugin (not measured)."""
    return {
        "bandwidth": Figure(100.0, "Gbit/s", measured=False),
        "latency": Figure(2.0, "us", measured=False),
        "zero_copy": Figure(1.0, "bool", measured=False),
    }


def result_from_report(report: verbs.VerbsReport, name: str = "rdma", priority: int = PRIORITY_RDMA) -> ProbeResult:
    """Turn a verbs report into the ``rdma`` probe result."""
    details: dict[str, Any] = {"stage": report.stage, "pyverbs": report.pyverbs, "interpreter": report.interpreter}
    if report.stage in ("missing", "import"):
        return ProbeResult(name, False, "library_missing", f"pyverbs not found: {INSTALL_HINT} ({report.error})",
                           priority=priority, details=details)
    if report.stage == "timeout":
        return ProbeResult(name, False, "timeout", report.error, priority=priority, details=details)
    if report.stage == "crash":
        return ProbeResult(name, False, "error", report.error, priority=priority, details=details)
    if report.stage == "list" or not report.devices:
        why = f" ({report.error})" if report.error else ""
        return ProbeResult(name, False, "no_devices", f"no RDMA devices: ibv_get_device_list found none{why}; "
                           "an RDMA NIC (or rxe/siw soft-RoCE) is needed", priority=priority, details=details)
    details["devices"] = list(report.devices)
    details["data_path"] = False
    details["data_path_note"] = NO_DATA_PATH
    active = [f"{d['name']}:{p['port']}" for d in report.devices for p in d.get("ports", ()) if p.get("active")]
    if not active:
        names = ", ".join(d["name"] for d in report.devices)
        return ProbeResult(name, False, "no_active_ports", f"RDMA devices ({names}) have no ACTIVE port",
                           priority=priority, details=details)
    return ProbeResult(name, True, "ok", f"{len(active)} active port(s): {', '.join(active)}",
                       priority=priority, figures=declared_figures(), details=details)


class RdmaTransport(ProbeOnlyTransport):
    """RDMA verbs (InfiniBand, RoCE). Probe: list devices, active ports and GIDs with pyverbs."""

    name = "rdma"
    no_data_path = NO_DATA_PATH
    default_priority = PRIORITY_RDMA

    @classmethod
    def host_fingerprint(cls) -> dict[str, Any]:
        """See :func:`genie_rdma.verbs.host_fingerprint`."""
        return verbs.host_fingerprint()

    async def probe(self, target: ProbeTarget) -> ProbeResult:
        """Run the verbs probe in a subprocess and report devices, ports and GIDs."""
        report = await self.run_blocking_probe(verbs.verbs_report, target)
        return result_from_report(report, self.name, self.default_priority)

