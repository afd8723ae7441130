"""List RDMA devices, their ports and GIDs with pyverbs, and print one JSON object.

Run by :func:`genie_rdma.verbs.verbs_report` as ``<python> -I _verbs_probe.py`` with
an interpreter that can import pyverbs (this one, or Debian's ``/usr/bin/python3``
with ``python3-pyverbs``); never imported by genie itself. Standard library and
pyverbs only. The report: ``{"stage": ..., "error": ..., "devices": [{"name",
"ports": [{"port", "state", "active", "gid", "link_layer"}]}], "pyverbs": path}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def probe() -> dict[str, Any]:
    """Import pyverbs, list devices, query each port."""
    report: dict[str, Any] = {"stage": "import", "error": None, "devices": [], "pyverbs": None}
    try:
        import pyverbs
        import pyverbs.device as device
        import pyverbs.enums as enums
    except ImportError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        return report
    report["pyverbs"] = getattr(pyverbs, "__file__", None)
    report["stage"] = "list"
    try:
        found = device.get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when verbs finds no device
        report["error"] = f"{type(exc).__name__}: {exc}"
        return report
    report["stage"] = "query"
    for dev in found:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        entry: dict[str, Any] = {"name": name, "ports": [], "error": None}
        try:
            with device.Context(name=name) as ctx:
                attr = ctx.query_device()
                for port in range(1, attr.phys_port_cnt + 1):
                    pattr = ctx.query_port(port)
                    try:
                        gid = str(ctx.query_gid(port, 0))
                    except Exception as exc:
                        gid = f"unreadable ({exc})"
                    entry["ports"].append({
                        "port": port,
                        "state": device.port_state_to_str(pattr.state),
                        "active": pattr.state == enums.IBV_PORT_ACTIVE,
                        "link_layer": device.translate_link_layer(pattr.link_layer),
                        "gid": gid,
                    })
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        report["devices"].append(entry)
    report["stage"] = "done"
    return report


def main() -> int:
    try:
        report = probe()
    except Exception as exc:
        report = {"stage": "crash", "error": f"{type(exc).__name__}: {exc}", "devices": []}
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
