"""Host figures through psutil: a compact snapshot for the ``genie_node_metrics`` hook.

The snapshot is a flat dict of plain numbers, so it travels in a heartbeat as is::

    {"cpu_percent": 12.5, "cpu_count": 2, "load_1m": 0.4, "load_5m": 0.3, "load_15m": 0.2,
     "memory_total": 8_300_000_000, "memory_used": 2_100_000_000, "memory_percent": 25.3,
     "disk_total": ..., "disk_used": ..., "disk_percent": 41.0,
     "net_bytes_sent": ..., "net_bytes_recv": ...}

Byte figures are bytes; ``*_percent`` are 0..100. ``net_bytes_*`` are counters since boot.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import psutil

log = logging.getLogger("genie.cluster.host")

#: The file system whose usage the snapshot reports.
DISK_PATH = "/"


def host_metrics(disk_path: str = DISK_PATH) -> dict[str, Any]:
    """One host snapshot; a figure the platform cannot give is left out (never an exception).

    ``cpu_percent`` is the system-wide use since the previous call (psutil keeps the
    previous reading); the first call of a process reports 0.0.
    """
    out: dict[str, Any] = {}
    try:
        out["cpu_percent"] = float(psutil.cpu_percent(interval=None))
        out["cpu_count"] = psutil.cpu_count() or 0
    except OSError as exc:
        log.debug("cpu figures unavailable: %s", exc)
    try:
        out["load_1m"], out["load_5m"], out["load_15m"] = (float(x) for x in os.getloadavg())
    except (AttributeError, OSError):
        pass  # no load average on this platform
    try:
        mem = psutil.virtual_memory()
        out.update(memory_total=int(mem.total), memory_used=int(mem.total - mem.available),
                   memory_percent=float(mem.percent))
    except OSError as exc:
        log.debug("memory figures unavailable: %s", exc)
    try:
        disk = psutil.disk_usage(disk_path)
        out.update(disk_total=int(disk.total), disk_used=int(disk.used), disk_percent=float(disk.percent))
    except OSError as exc:
        log.debug("disk figures for %s unavailable: %s", disk_path, exc)
    try:
        net = psutil.net_io_counters()
        if net is not None:
            out.update(net_bytes_sent=int(net.bytes_sent), net_bytes_recv=int(net.bytes_recv))
    except OSError as exc:
        log.debug("network counters unavailable: %s", exc)
    return out
