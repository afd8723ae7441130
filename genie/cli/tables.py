"""The tables and bars that ``genie status`` and ``genie dashboard`` draw with rich (pure: no I/O).

Each takes :class:`~genie.cluster.overview.NodeView` summaries of a master's QUERY
reply and returns a rich renderable, so what the two commands show always agrees.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from genie.cluster.overview import DeviceView, NodeView, mapping

_STATUS_STYLE = {"connected": "green", "lost": "bold white on red", "disconnected": "yellow", "connecting": "cyan"}
_HEALTH_STYLE = {"healthy": "green", "degraded": "yellow", "unhealthy": "red", "critical": "bold white on red"}


def format_bytes(n: float | None) -> str:
    """``12.3 GiB`` style (binary units); ``-`` for unknown."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def format_age(seconds: float | None) -> str:
    """``0.2 s``, ``12 s``, ``3 min``, ``2.0 h``; ``-`` for unknown."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def status_text(status: str) -> Text:
    """A node's connection state; ``LOST`` in capitals on red."""
    shown = status.upper() if status in ("lost", "disconnected") else status
    return Text(shown, style=_STATUS_STYLE.get(status, "white"))


def health_text(grade: str | None) -> Text:
    if grade is None:
        return Text("unknown", style="dim")
    return Text(grade.upper(), style=_HEALTH_STYLE.get(grade, "white"))


def bar(percent: float | None, width: int = 20, *, warn: float = 70.0, alarm: float = 90.0) -> Text:
    """``[#########...........]  45%`` coloured by level; an empty bar and ``n/a`` when unknown."""
    if percent is None:
        return Text("[" + "." * width + "]  n/a", style="dim")
    p = min(max(percent, 0.0), 100.0)
    filled = round(p / 100 * width)
    style = "red" if p >= alarm else "yellow" if p >= warn else "green"
    out = Text("[")
    out.append("#" * filled, style=style)
    out.append("." * (width - filled), style="dim")
    out.append(f"] {p:3.0f}%")
    return out


def temperature_text(celsius: float | None) -> Text:
    if celsius is None:
        return Text("-", style="dim")
    style = "bold red" if celsius >= 85 else "yellow" if celsius >= 75 else "green"
    return Text(f"{celsius:.0f} C", style=style)


def nodes_table(views: Sequence[NodeView]) -> Table:
    """One row per node: id, role, connection, health, backend, data address, heartbeat age, host CPU and memory."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="nodes", title_justify="left")
    for col in ("node", "role", "status", "health", "backend", "address", "heartbeat", "cpu", "mem"):
        table.add_column(col, no_wrap=col != "address", overflow="fold",
                         justify="right" if col in ("heartbeat", "cpu", "mem") else "left")
    for v in views:
        cpu, mem = (v.host.get(k) for k in ("cpu_percent", "memory_percent"))
        table.add_row(v.node_id, v.role, status_text(v.status), health_text(v.health) if v.serving else Text("-"),
                      ",".join(v.backends) or "-", f"{v.address}:{v.data_port}" if v.address else "-",
                      format_age(v.last_heartbeat_age),
                      *(f"{x:.0f}%" if isinstance(x, (int, float)) else "-" for x in (cpu, mem)))
    return table


def _device_name(d: DeviceView) -> str:
    suffix = " (host)" if d.source == "host" else ""
    return f"{d.name or d.kind}{suffix}"


def devices_table(views: Sequence[NodeView], *, bar_width: int = 10) -> Table:
    """One row per device (# is N of remote_accelerator:N): node, name, utilization and memory bars, temperature."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="devices (# is N of remote_accelerator:N)",
                  title_justify="left")
    for col in ("#", "node", "name", "utilization", "memory", "used / total", "temp"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("#", "temp") else "left")
    for v in views:
        gone = v.status != "connected"
        for d in v.devices:
            if gone:
                util, mem = Text(f"[{'-' * bar_width}] {v.status.upper()}", style="red"), Text("")
            else:
                util, mem = bar(d.utilization, bar_width), bar(d.memory_percent, bar_width)
            index = str(d.cluster_index) if d.cluster_index is not None else f"{d.node_id}/{d.local_index}"
            used = format_bytes(d.memory_used).replace(" GiB", "") if d.memory_total else "-"
            table.add_row(index, v.node_id, _device_name(d), util, mem,
                          f"{used} / {format_bytes(d.memory_total)}" if d.memory_total else "-",
                          temperature_text(d.temperature))
    return table


def sessions_table(views: Sequence[NodeView]) -> Table | Text:
    """Who uses which device: one row per client session and device, with memory held, ops and op time."""
    rows = [u for v in views for u in v.sessions]
    if not rows:
        return Text("sessions: no client holds a session", style="dim")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="sessions (per client, per device)",
                  title_justify="left")
    for col in ("device", "node", "client", "identity", "memory", "ops", "op time"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("memory", "ops", "op time") else "left")
    for u in sorted(rows, key=lambda u: (u.device_label, -u.memory, u.client)):
        table.add_row(u.device_label, u.node_id, u.client, u.identity, format_bytes(u.memory), str(u.ops),
                      f"{u.op_seconds:.3f} s")
    return table


def health_table(views: Sequence[NodeView]) -> Table | Text:
    """The checks that are not healthy, per node; one green line when there are none."""
    rows = [(v, c) for v in views if v.serving for c in v.checks if c.get("status") != "healthy"]
    if not rows:
        return Text("health: every reported check is healthy", style="green")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="failing checks", title_justify="left")
    for col in ("node", "check", "grade", "message"):
        table.add_column(col, no_wrap=col != "message")
    for v, c in rows:
        table.add_row(v.node_id, str(c.get("name", "?")), health_text(str(c.get("status"))), str(c.get("message", "")))
    return table


def event_line(event: Mapping[str, Any]) -> Text:
    """``12:34:56 node_lost  w1  key=value ...``."""
    stamp = event.get("timestamp")
    when = time.strftime("%H:%M:%S", time.localtime(stamp)) if isinstance(stamp, (int, float)) else "--:--:--"
    kind = str(event.get("type", "?"))
    style = "red" if kind in ("node_lost", "gpu_overheated", "gpu_unavailable", "backend_fallback") else (
        "green" if kind in ("node_joined", "node_recovered", "gpu_available") else "cyan")
    data = mapping(event.get("data"))
    details = " ".join(f"{k}={v}" for k, v in data.items() if v not in (None, [], {}, ""))
    out = Text(f"{when} ")
    out.append(f"{kind:<16}", style=style)
    out.append(f" {event.get('source', '')} ")
    out.append(details, style="dim")
    return out


