"""The event bus: cluster events from any thread, delivered in order on the runtime loop.

The bus lives on genie's runtime thread. Its owner starts it with
``await task_group.start(bus.run)``; :meth:`EventBus.publish` may then be called
from any thread (it hands the event over without blocking), :meth:`EventBus.apublish`
from coroutines on the bus's own loop. One dispatcher delivers events in the order
they were published (hence in order per source) to every matching subscriber and to
every sink from the ``genie_event_sinks`` hook::

    bus = EventBus(pm=get_plugin_manager())
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        with bus.subscribe(on_gpu_event, types={EventType.GPU_OVERHEATED}):
            bus.publish(ClusterEvent(EventType.GPU_OVERHEATED, "node-1", {"gpu": 0}))
        ...
        bus.close()          # or cancel tg: queued events are then dropped

Handlers and sinks run on the event loop: they must be quick. A synchronous handler
that has slow work to do hands it to ``anyio.to_thread``; an ``async`` handler is
awaited, and holds up the events behind it while it runs. A handler or sink that
raises is logged on ``genie.events`` and never stops the others.
"""

from __future__ import annotations

import collections
import contextvars
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal

from genie.types import ClusterEvent, EventType

if TYPE_CHECKING:
    from genie.plugins import PluginManager

log = logging.getLogger("genie.events")

EventHandler = Callable[[ClusterEvent], "Awaitable[None] | None"]

#: True inside the dispatcher task, so that apublish() from a handler does not wait on itself.
_in_dispatch: contextvars.ContextVar[bool] = contextvars.ContextVar("genie_in_dispatch", default=False)


class Subscription:
    """A handler's registration on a bus: call :meth:`unsubscribe`, or use it as a context manager."""

    def __init__(self, bus: EventBus, handler: EventHandler, types: frozenset[EventType] | None) -> None:
        self.bus = bus
        self.handler = handler
        self.types = types
        self.active = True

    def matches(self, event: ClusterEvent) -> bool:
        """True when this subscription wants ``event``."""
        return self.active and (self.types is None or event.type in self.types)

    def unsubscribe(self) -> None:
        """Stop delivery to this handler (idempotent, any thread). An event being delivered may still arrive."""
        self.bus._remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unsubscribe()

    def __repr__(self) -> str:
        kinds = "all" if self.types is None else ",".join(sorted(t.value for t in self.types))
        return f"<Subscription {getattr(self.handler, '__qualname__', self.handler)!r} types={kinds} active={self.active}>"


class EventBus:
    """Publishes :class:`~genie.types.ClusterEvent` to subscribers and sinks, in order.

    :param pm: plugin manager whose ``genie_event_sinks`` hook supplies sinks (called
        once, when :meth:`run` starts). None: only the ``sinks`` given here.
    :param sinks: extra sinks, objects with ``handle(event) -> None``.
    :param history: how many recent events :meth:`recent` keeps.
    :param max_pending: bound on events published but not yet delivered; beyond it
        the oldest undelivered events are dropped (and counted in :attr:`dropped`).
    """

    def __init__(
        self,
        *,
        pm: PluginManager | None = None,
        sinks: Iterable[Any] = (),
        history: int = 1000,
        max_pending: int = 10_000,
    ) -> None:
        self._pm = pm
        self._extra_sinks = list(sinks)
        self.sinks: list[Any] = []
        self._lock = threading.Lock()
        self._subscriptions: tuple[Subscription, ...] = ()
        self._pending: collections.deque[tuple[ClusterEvent, anyio.Event | None]] = collections.deque()
        self._max_pending = max_pending
        self._recent: collections.deque[ClusterEvent] = collections.deque(maxlen=history)
        self._wake: anyio.Event | None = None
        self._wake_scheduled = False
        self._portal: BlockingPortal | None = None
        self._loop_thread: int | None = None
        self._closing = False
        self._running = False
        self.published = 0  #: events accepted by publish()/apublish()
        self.delivered = 0  #: events the dispatcher has handed to every subscriber and sink
        self.dropped = 0  #: events dropped because more than max_pending were waiting

    # -- subscribing ------------------------------------------------------------------------
    def subscribe(self, handler: EventHandler, types: Iterable[EventType] | None = None) -> Subscription:
        """Deliver every later event (of ``types``, or all) to ``handler``; any thread.

        ``handler(event)`` may be a plain function or a coroutine function; it runs on
        the bus's event loop.
        """
        sub = Subscription(self, handler, None if types is None else frozenset(EventType(t) for t in types))
        with self._lock:
            self._subscriptions = (*self._subscriptions, sub)
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            sub.active = False
            self._subscriptions = tuple(s for s in self._subscriptions if s is not sub)

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        """The active subscriptions, in subscription order."""
        return self._subscriptions

    # -- publishing -------------------------------------------------------------------------
    def publish(self, event: ClusterEvent) -> None:
        """Queue ``event`` for delivery; callable from any thread, never blocks.

        Before :meth:`run` starts, events wait and are delivered once it does.
        """
        self._enqueue(event, None)

    async def apublish(self, event: ClusterEvent) -> None:
        """Publish from a coroutine on the bus's loop and wait until every handler and sink has had it.

        Called from inside a handler (or while the bus is not running) it only
        queues the event, since waiting there could never end.
        """
        running_here = self._running and self._loop_thread == threading.get_ident()
        done = anyio.Event() if running_here and not _in_dispatch.get() else None
        if self._enqueue(event, done) and done is not None:
            await done.wait()

    def _enqueue(self, event: ClusterEvent, done: anyio.Event | None) -> bool:
        """Queue ``event``; False when the bus is closed and the event was dropped."""
        if not isinstance(event, ClusterEvent):
            raise TypeError(f"EventBus.publish() takes a ClusterEvent, not {type(event).__name__}")
        wake_now = schedule = False
        dropped_done: anyio.Event | None = None
        with self._lock:
            if self._closing:
                log.warning("event %s from %s published after the bus closed; dropped", event.type.value, event.source)
                return False
            self.published += 1
            self._recent.append(event)
            if len(self._pending) >= self._max_pending:
                _, dropped_done = self._pending.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("event bus backlog over %d events: %d dropped so far", self._max_pending, self.dropped)
            self._pending.append((event, done))
            if self._running:
                if self._loop_thread == threading.get_ident():
                    wake_now = True
                elif not self._wake_scheduled:
                    self._wake_scheduled = schedule = True
        if dropped_done is not None:
            # Only a coroutine on the loop waits on it, and anyio events are set from the loop.
            self._on_loop(dropped_done.set)
        if wake_now:
            self._set_wake()
        elif schedule:
            self._schedule_wake()
        return True

    def _set_wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
            wake = self._wake
        if wake is not None:
            wake.set()

    def _schedule_wake(self) -> None:
        if not self._on_loop(self._set_wake):
            self._wake_scheduled = False

    def _on_loop(self, func: Callable[[], object]) -> bool:
        """Run ``func`` on the bus's loop: now if this is the loop thread, else soon; False if it cannot."""
        if self._loop_thread == threading.get_ident():
            func()
            return True
        portal = self._portal
        if portal is None:
            return False
        try:
            portal.start_task_soon(func)
        except RuntimeError:
            # The portal is closing: the dispatcher drains whatever it still can on its way out.
            return False
        return True

    # -- history ----------------------------------------------------------------------------
    def recent(self, limit: int | None = None, types: Iterable[EventType] | None = None) -> list[ClusterEvent]:
        """The most recent published events, oldest first (at most ``limit``, optionally of ``types``)."""
        with self._lock:
            events = list(self._recent)
        if types is not None:
            wanted = {EventType(t) for t in types}
            events = [e for e in events if e.type in wanted]
        return events if limit is None else events[-limit:] if limit > 0 else []

    # -- running ----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True while :meth:`run` is delivering events."""
        return self._running

    def close(self) -> None:
        """Ask :meth:`run` to deliver what is queued and return; any thread, idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            here = self._running and self._loop_thread == threading.get_ident()
            schedule = self._running and not here
        if here:
            self._set_wake()
        elif schedule:
            self._schedule_wake()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Deliver events until :meth:`close` (then drain) or cancellation (then drop the rest).

        Start it with ``await task_group.start(bus.run)``: it reports started once
        the sinks are loaded and cross-thread publishing works.
        """
        if self._running:
            raise RuntimeError("EventBus.run() is already running")
        self.sinks = [*(self._pm.event_sinks() if self._pm is not None else []), *self._extra_sinks]
        async with BlockingPortal() as portal:
            with self._lock:
                self._portal = portal
                self._loop_thread = threading.get_ident()
                self._wake = anyio.Event()
                self._running = True
                self._wake_scheduled = False
            token = _in_dispatch.set(True)
            try:
                task_status.started()
                await self._dispatch_loop()
            finally:
                _in_dispatch.reset(token)
                with self._lock:
                    self._running = False
                    self._portal = None
                    self._loop_thread = None
                    leftover = list(self._pending)
                    self._pending.clear()
                for _, done in leftover:
                    if done is not None:
                        done.set()
                if leftover:
                    log.warning("event bus stopped with %d undelivered events", len(leftover))

    async def _dispatch_loop(self) -> None:
        while True:
            with self._lock:
                batch = list(self._pending)
                self._pending.clear()
                closing = self._closing
                if not batch and not closing:
                    self._wake = anyio.Event()
            if not batch:
                if closing:
                    return
                assert self._wake is not None
                await self._wake.wait()
                continue
            for event, done in batch:
                await self._deliver(event)
                if done is not None:
                    done.set()

    async def _deliver(self, event: ClusterEvent) -> None:
        for sink in self.sinks:
            try:
                sink.handle(event)
            except Exception:
                log.exception("event sink %r failed on %s from %s", _name_of(sink), event.type.value, event.source)
        for sub in self._subscriptions:
            if not sub.matches(event):
                continue
            try:
                result = sub.handler(event)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception(
                    "event handler %r failed on %s from %s", _name_of(sub.handler), event.type.value, event.source
                )
        self.delivered += 1


def _name_of(obj: Any) -> str:
    return str(getattr(obj, "name", None) or getattr(obj, "__qualname__", None) or type(obj).__name__)
