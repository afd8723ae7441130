"""``genie dashboard``: a live terminal view of a genie cluster, drawn with rich.

Three parts, kept apart so the drawing is testable without a terminal or a master:

- :func:`render` (pure): a :class:`Snapshot` (the last QUERY reply, the last error,
  recent events, the time) to a rich renderable: a header, the nodes, every device's
  utilization / memory / temperature bars, failing health checks and an event log.
- :class:`Feed` (I/O): a background thread with its own anyio loop that polls the
  master's QUERY every ``refresh`` seconds and follows its event stream, reconnecting
  forever; an unreachable master is data (``Snapshot.error``), never an exception.
- :func:`run`: ``rich.live.Live`` on the alternate screen, redrawn at least every
  second; keys are read in cbreak mode with ``select`` so waiting for a key never
  delays a redraw; ``q`` quits; the terminal is restored on every way out.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from genie.cluster.overview import DeviceView, NodeView, format_age, format_bytes, mapping, nodes

#: Events kept for the log (the newest that fit the screen are shown).
EVENT_LOG_SIZE = 500

_STATUS_STYLE = {"connected": "green", "lost": "bold white on red", "disconnected": "yellow", "connecting": "cyan"}
_HEALTH_STYLE = {"healthy": "green", "degraded": "yellow", "unhealthy": "red", "critical": "bold white on red"}


@attrs.frozen
class Snapshot:
    """Everything one frame shows. ``reply`` is the last good QUERY reply (None: none yet)."""

    master: str
    reply: Mapping[str, Any] | None = None
    error: str | None = None  #: why the last poll failed (None: it succeeded)
    updated: float | None = None  #: time.time() of ``reply``
    events: Sequence[Mapping[str, Any]] = ()
    now: float = attrs.field(factory=time.time)
    refresh: float = 1.0


# -- drawing (pure) ----------------------------------------------------------------------------
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


def header(snapshot: Snapshot, views: Sequence[NodeView]) -> Text:
    out = Text("genie dashboard  ", style="bold")
    out.append(f"master {snapshot.master}  ")
    if snapshot.error is not None:
        since = "" if snapshot.updated is None else f", last update {format_age(snapshot.now - snapshot.updated)} ago"
        out.append(f"master unreachable, retrying{since}: {snapshot.error}", style="bold white on red")
    else:
        counts: dict[str, int] = {}
        for v in views:
            counts[v.status] = counts.get(v.status, 0) + 1
        out.append(f"{len(views)} nodes: ")
        shown = [Text(f"{n} {s.upper() if s == 'lost' else s}", style=_STATUS_STYLE.get(s, "white"))
                 for s, n in sorted(counts.items())]
        out.append_text(Text(", ").join(shown))
    out.append(f"   refresh {snapshot.refresh:g} s   q quits", style="dim")
    return out


def render(snapshot: Snapshot, *, height: int = 40, bar_width: int = 10) -> RenderableType:
    """One frame: header, nodes, devices, failing checks, and as many recent events as fit ``height``."""
    views = nodes(snapshot.reply, now=snapshot.now) if snapshot.reply is not None else []
    parts: list[RenderableType] = [header(snapshot, views)]
    if snapshot.reply is None:
        parts.append(Panel(Text(f"waiting for the master at {snapshot.master} ...", style="yellow"),
                           title="no data yet"))
        used = 4
    else:
        parts += [nodes_table(views), devices_table(views, bar_width=bar_width), health_table(views)]
        failing = sum(1 for v in views for c in v.checks if c.get("status") != "healthy")
        used = 1 + (len(views) + 4) + (sum(len(v.devices) for v in views) + 4) + (failing + 4 if failing else 1)
    rows = max(3, height - used - 2)
    shown = list(snapshot.events)[-rows:]
    log = Text("\n").join(event_line(e) for e in shown) if shown else Text("no events yet", style="dim")
    parts.append(Panel(log, title=f"events (last {len(shown)} of {len(snapshot.events)})", title_align="left",
                       box=box.SQUARE))
    return Group(*parts)


# -- data (I/O) ----------------------------------------------------------------------------------
def _event_key(event: Mapping[str, Any]) -> tuple[Any, ...]:
    return (event.get("timestamp"), event.get("type"), event.get("source"))


class Feed:
    """Polls the master's QUERY and follows its events from a background thread; read with :meth:`snapshot`."""

    def __init__(self, host: str, port: int, *, refresh: float = 1.0, timeout: float | None = None) -> None:
        self.host, self.port, self.refresh = host, port, refresh
        self.timeout = timeout if timeout is not None else max(2.0, 2 * refresh)
        self._lock = threading.Lock()
        self._reply: Mapping[str, Any] | None = None
        self._error: str | None = None
        self._updated: float | None = None
        self._events: list[Mapping[str, Any]] = []
        self._seen: set[tuple[Any, ...]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="genie-dashboard-feed", daemon=True)

    def start(self) -> Feed:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end; it notices within about ``refresh`` seconds (it is a daemon thread anyway)."""
        self._stop.set()
        self._thread.join(timeout)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(master=f"{self.host}:{self.port}", reply=self._reply, error=self._error,
                            updated=self._updated, events=tuple(self._events), refresh=self.refresh)

    def add_events(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Merge events (from a QUERY reply or the stream), dropping ones already seen, in time order."""
        with self._lock:
            fresh = [e for e in events if _event_key(e) not in self._seen]
            if not fresh:
                return
            self._seen.update(_event_key(e) for e in fresh)
            self._events.extend(fresh)
            self._events.sort(key=lambda e: e.get("timestamp") or 0.0)
            if len(self._events) > EVENT_LOG_SIZE:
                for e in self._events[:-EVENT_LOG_SIZE]:
                    self._seen.discard(_event_key(e))
                del self._events[:-EVENT_LOG_SIZE]

    def _main(self) -> None:
        import anyio

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._poll)
                tg.start_soon(self._follow)
                while not self._stop.is_set():
                    await anyio.sleep(0.1)
                tg.cancel_scope.cancel()

        anyio.run(main)

    async def _poll(self) -> None:
        import anyio

        from genie.cluster.query import query_master

        while True:
            try:
                reply = await query_master(self.host, self.port, timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - anything the master does is shown, never raised
                with self._lock:
                    self._error = str(exc) or type(exc).__name__
            else:
                with self._lock:
                    self._reply, self._error, self._updated = reply, None, time.time()
                self.add_events([e for e in reply.get("events") or () if isinstance(e, Mapping)])
            await anyio.sleep(self.refresh)

    async def _follow(self) -> None:
        import anyio

        from genie.cluster.query import follow_events

        while True:
            try:
                async for event in follow_events(self.host, self.port, timeout=self.timeout):
                    self.add_events([event.to_dict()])
            except Exception:  # noqa: BLE001, S110 - the poll shows the master's state; just reconnect
                pass
            await anyio.sleep(self.refresh)


# -- the terminal --------------------------------------------------------------------------------
class Keys:
    """Single key presses from a terminal in cbreak mode (no echo, no line buffering); restores it on exit."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stdin
        self.fd: int | None = None
        self._saved: Any = None

    def __enter__(self) -> Keys:
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            return self
        if not os.isatty(fd):
            return self
        import termios
        import tty

        self.fd, self._saved = fd, termios.tcgetattr(fd)
        tty.setcbreak(fd)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None and self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def read(self, timeout: float) -> str:
        """Keys pressed within ``timeout`` seconds ('' when none, or when not reading a terminal)."""
        if self.fd is None:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return ""
        data = os.read(self.fd, 64)
        return data.decode(errors="ignore") if data else ""


@contextlib.contextmanager
def _feed(host: str, port: int, refresh: float, timeout: float | None) -> Iterator[Feed]:
    feed = Feed(host, port, refresh=refresh, timeout=timeout).start()
    try:
        yield feed
    finally:
        feed.stop()


def _fit(console: Console) -> None:
    """Follow the terminal's real size (resizes included), over a COLUMNS/LINES set in the environment."""
    try:
        columns, lines = os.get_terminal_size(console.file.fileno())
    except (AttributeError, OSError, ValueError):
        return
    console.size = (columns, lines)


def run(host: str, port: int, *, refresh: float = 1.0, timeout: float | None = None, console: Console | None = None,
        screen: bool = True) -> int:
    """Show the dashboard until ``q`` (returns 0); Ctrl-C raises KeyboardInterrupt after restoring the terminal."""
    from rich.live import Live

    console = console or Console()
    redraw = min(refresh, 0.5)  # the heartbeat ages tick between polls
    with _feed(host, port, refresh, timeout) as feed, Keys() as keys, Live(
            console=console, screen=screen, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as live:
        while True:
            _fit(console)
            width, height = console.size
            live.update(render(feed.snapshot(), height=height, bar_width=20 if width >= 120 else 10), refresh=True)
            if "q" in keys.read(redraw).lower():
                return 0
