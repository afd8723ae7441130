"""pytest plugin for genie and its plugins (registered through the ``pytest11`` entry point).

Fixtures:

- ``genie_pm``: a :class:`~genie.plugins.PluginManager` without entry-point autoload
  (built-ins only), so a test sees exactly the plugins it registers.
- ``register_plugin``: registers an inline plugin object on ``genie_pm`` and always
  unregisters it at teardown.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from genie.plugins import PluginManager

_names = itertools.count()


@pytest.fixture
def genie_pm() -> PluginManager:
    """A plugin manager with the built-ins only (no entry points loaded)."""
    return PluginManager(autoload=False, environ={})


@pytest.fixture
def register_plugin(genie_pm: PluginManager) -> Iterator[Callable[..., str]]:
    """Register ``plugin`` (any object with hook implementations); returns its name."""
    registered: list[str] = []

    def register(plugin: object, name: str | None = None) -> str:
        name = name or f"inline-{next(_names)}"
        genie_pm.register(plugin, name=name)
        registered.append(name)
        return name

    yield register
    for name in registered:
        if name in genie_pm.records:
            genie_pm.unregister(name)


# -- event recorder ------------------------------------------------------------------------------
# Imported here, not at the top: this section is appended to the module as a unit.
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable  # noqa: E402

import anyio  # noqa: E402

from genie.cluster.events import EventBus, Subscription  # noqa: E402
from genie.types import ClusterEvent, EventType  # noqa: E402


class EventRecorder:
    """Records every event a :class:`~genie.cluster.events.EventBus` delivers.

    ``events`` is the list so far; :meth:`wait_for` (on the bus's loop) and
    :meth:`wait_for_blocking` (from any other thread) wait a bounded time for an
    event of a type and fail the test, listing what was seen, when none arrives.
    """

    def __init__(self) -> None:
        self.events: list[ClusterEvent] = []
        self._cond = threading.Condition()
        self._waiters: list[anyio.Event] = []
        self._subscriptions: list[Subscription] = []

    def attach(self, bus: EventBus, types: Iterable[EventType] | None = None) -> EventRecorder:
        """Subscribe to ``bus`` (all events, or only ``types``); detached at teardown."""
        self._subscriptions.append(bus.subscribe(self._record, types))
        return self

    def detach(self) -> None:
        """Unsubscribe from every bus this recorder is attached to."""
        for sub in self._subscriptions:
            sub.unsubscribe()
        self._subscriptions.clear()

    def _record(self, event: ClusterEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.set()

    def of_type(self, event_type: EventType) -> list[ClusterEvent]:
        """The recorded events of ``event_type``, in delivery order."""
        with self._cond:
            return [e for e in self.events if e.type == event_type]

    def _failure(self, event_type: EventType, timeout: float, count: int) -> AssertionError:
        seen = ", ".join(f"{e.type.value}@{e.source}" for e in self.events) or "nothing"
        return AssertionError(
            f"expected {count} {EventType(event_type).value} event(s) within {timeout:g} s; saw: {seen}"
        )

    async def wait_for(self, event_type: EventType, timeout: float = 2.0, *, count: int = 1) -> ClusterEvent:
        """Wait (at most ``timeout`` s) until ``count`` events of ``event_type`` were recorded; the last one."""
        with anyio.move_on_after(timeout):
            while True:
                with self._cond:
                    found = [e for e in self.events if e.type == event_type]
                    if len(found) >= count:
                        return found[count - 1]
                    waiter = anyio.Event()
                    self._waiters.append(waiter)
                await waiter.wait()
        raise self._failure(event_type, timeout, count)

    def wait_for_blocking(self, event_type: EventType, timeout: float = 2.0, *, count: int = 1) -> ClusterEvent:
        """Like :meth:`wait_for`, from a thread other than the bus's."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [e for e in self.events if e.type == event_type]
                if len(found) >= count:
                    return found[count - 1]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._failure(event_type, timeout, count)
                self._cond.wait(left)


@pytest.fixture
def event_recorder() -> Iterator[Callable[..., EventRecorder]]:
    """``event_recorder(bus, types=None)`` -> an :class:`EventRecorder` attached to ``bus``, detached at teardown."""
    recorders: list[EventRecorder] = []

    def attach(bus: EventBus, types: Iterable[EventType] | None = None) -> EventRecorder:
        recorder = EventRecorder().attach(bus, types)
        recorders.append(recorder)
        return recorder

    yield attach
    for recorder in recorders:
        recorder.detach()


# -- data-plane server processes ---------------------------------------------------------------

import contextlib  # noqa: E402

from genie.cluster.launch import NodeProcess  # noqa: E402

#: The bare data-plane server process (``python -m genie.server``): ``.port``, ``.log()``, ``.alive()``, ``.process``.
ServerProcess = NodeProcess


@contextlib.contextmanager
def serve_subprocess(*args: str, ready_timeout: float = 60.0, log_level: str = "INFO",
                     env: dict[str, str] | None = None) -> Iterator[NodeProcess]:
    """Run ``python -m genie.server ARGS`` (a bare data-plane server) until its ready line; always stop it."""
    with NodeProcess.data_plane("--log-level", log_level, *args, env=env, ready_timeout=ready_timeout) as server:
        yield server


@pytest.fixture(scope="session")
def genie_serve() -> Iterator[NodeProcess]:
    """One data-plane server process (``--port 0 --devices cpu,cpu``) shared by a test session, killed at the end."""
    with serve_subprocess("--port", "0", "--devices", "cpu,cpu") as server:
        yield server
