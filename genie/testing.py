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


# -- network namespaces --------------------------------------------------------------------------

import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import uuid  # noqa: E402

import attrs  # noqa: E402


@attrs.frozen
class VethPair:
    """Two network namespaces joined by a veth pair: as far as the network goes, two hosts."""

    ns_a: str
    addr_a: str
    ns_b: str
    addr_b: str

    def argv(self, ns: str, *command: str) -> list[str]:
        """``command`` run inside namespace ``ns`` (``ip netns exec``)."""
        return ["ip", "netns", "exec", ns, *command]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def veth_namespaces() -> Iterator[VethPair]:
    """Fresh namespaces named for this test (``genie-<tag>-a/-b``), joined by veth, always deleted.

    Skips with the reason where they cannot be made (not root, no iproute2).
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"genie-{tag}-a", f"genie-{tag}-b"
    octet = int(tag[:2], 16) % 250 + 1
    addr_a, addr_b = f"10.231.{octet}.1", f"10.231.{octet}.2"
    created = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", f"gv{tag}a", "netns", ns_a, "type", "veth", "peer", "name", f"gv{tag}b", "netns", ns_b)
        for ns, dev, addr in ((ns_a, f"gv{tag}a", addr_a), (ns_b, f"gv{tag}b", addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield VethPair(ns_a, addr_a, ns_b, addr_b)
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


# -- client processes ------------------------------------------------------------------------------

import sys  # noqa: E402
import textwrap  # noqa: E402


def run_client(control_port: int, body: str, *, env: dict[str, str] | None = None, host: str = "127.0.0.1",
               timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter after ``genie.init_sync`` against a master (one init per process).

    ``body`` sees ``genie``, ``torch`` and ``state`` (init's ClusterState); genie is shut down after it.
    """
    script = "\n".join([
        "import genie, torch",
        f"state = genie.init_sync(master_addr={host!r}, master_port={int(control_port)}, timeout=30)",
        "try:",
        textwrap.indent(textwrap.dedent(body).strip(), "    "),
        "finally:",
        "    genie.shutdown_sync()",
    ])
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
