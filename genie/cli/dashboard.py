"""``genie dashboard``: a live terminal view of a genie cluster, drawn with rich (a core dependency).

Polls the master every ``--refresh`` seconds and follows its event stream; an
unreachable master is shown ("master unreachable, retrying") until it answers. ``q``
quits with exit code 0, Ctrl-C with 130.

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

import argparse
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
from rich.text import Text

from genie.cli._master import add_master_arguments, master_address
from genie.cli.tables import (
    _STATUS_STYLE,
    devices_table,
    event_line,
    format_age,
    health_table,
    nodes_table,
    sessions_table,
)
from genie.cluster.overview import NodeView, nodes
from genie.errors import ConfigError

#: Events kept for the log (the newest that fit the screen are shown).
EVENT_LOG_SIZE = 500



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
        parts += [nodes_table(views), devices_table(views, bar_width=bar_width), sessions_table(views),
                  health_table(views)]
        failing = sum(1 for v in views for c in v.checks if c.get("status") != "healthy")
        sessions = sum(len(v.sessions) for v in views)
        used = 1 + (len(views) + 4) + (sum(len(v.devices) for v in views) + 4) + (failing + 4 if failing else 1) \
            + (sessions + 4 if sessions else 1)
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


# -- the subcommand ------------------------------------------------------------------------------
def register(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="live terminal dashboard of a running cluster (q quits)")
    add_master_arguments(p)
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between polls of the master (default 1)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not 0.05 <= args.refresh <= 60:
        raise ConfigError("refresh", args.refresh, "argument --refresh", "seconds from 0.05 to 60")
    host, port = master_address(args)
    return run(host, port, refresh=args.refresh, timeout=args.timeout)
