"""The test kit of genie and its plugins: a pytest plugin (``pytest11`` entry point) and helpers.

Third-party plugin authors get it with ``pip install genie``; pytest loads the fixtures by
itself. Everything here waits on observable state within a bounded time (never a bare sleep)
and binds port 0 (never "find a free port, release it, hope nobody takes it"): each server
reports the port it bound.

Plugins:

- ``genie_pm``: a :class:`~genie.plugins.PluginManager` with the built-ins only (no entry points).
- ``register_plugin(plugin, name=None)``: registers an inline plugin on ``genie_pm``, unregistered at teardown.

Events:

- ``event_recorder(bus, types=None)``: an :class:`EventRecorder` attached to an
  :class:`~genie.cluster.events.EventBus`; ``wait_for(type)`` waits for an event, failing with what it saw.

Servers and clusters (real processes on loopback, always stopped, even when a test fails):

- ``genie_serve``: one bare data-plane server process (``python -m genie.server``) per test session.
  Its ``--devices`` are :func:`shared_server_devices`: two CPU devices, or what
  ``GENIE_TEST_SERVER_DEVICES`` names (``cuda:0,cuda:0`` runs the same tests with the server on a GPU).
- ``genie_inproc_server(devices=2, transport=None, **options)``: an in-process
  :class:`~genie.server.DataPlaneServer` (TCP unless told otherwise) on port 0; ``.port`` is bound.
- ``genie_cluster(workers=("w1",), ...)``: a :class:`LocalCluster`, a ``genie serve`` master on port 0
  and ``genie worker`` processes joined to it.

Helpers: :func:`wait_until` (poll a predicate), :func:`wait_until_async` (the same on an event
loop), :func:`refused_port` (a port where connections are refused for as long as it is held),
:class:`~genie.testing.link.LinkEmulator` (a proxy that adds delay, caps bandwidth, cuts and stalls),
:func:`announce_node` (a ``node_joined`` event on demand, to see that a subscription is live),
:class:`NodeProcess` (one node process).

Quick start, in a plugin's test::

    from genie.testing import wait_until

    def test_my_backend_reaches_a_real_cluster(genie_cluster):
        cluster = genie_cluster(workers=("w1",), env={"GENIE_BACKEND": "mine"})
        wait_until(lambda: cluster.worker("w1").alive(), 5)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio
import attrs
import pytest

from genie.cluster.events import EventBus, Subscription
from genie.cluster.launch import READY_TIMEOUT, NodeProcess
from genie.errors import GenieError
from genie.plugins import PluginManager, get_plugin_manager
from genie.security import ClientSecurity
from genie.testing.link import LinkEmulator
from genie.types import ClusterEvent, EventType

if TYPE_CHECKING:
    from genie.server import DataPlaneServer
    from genie.transport.base import Transport

__all__ = [
    "EventRecorder",
    "LinkEmulator",
    "LocalCluster",
    "NodeProcess",
    "ServerProcess",
    "announce_node",
    "refused_port",
    "serve_subprocess",
    "shared_server_devices",
    "wait_until",
    "wait_until_async",
]

T = TypeVar("T")
_names = itertools.count()


# -- waiting -------------------------------------------------------------------------------------

def wait_until(predicate: Callable[[], T | Literal[False] | None], timeout: float, step: float = 0.02, *,
               what: str = "") -> T:
    """Poll ``predicate`` until it returns something true, and return that; AssertionError after ``timeout`` s.

    ``what`` names the awaited state in the failure message. Poll only observable state (a log
    line, a query's answer, a process's exit), never elapsed time.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout:g} s")
        time.sleep(step)


@overload
async def wait_until_async(predicate: Callable[[], Awaitable[T | Literal[False] | None]], timeout: float,
                           step: float = ..., *, what: str = ...) -> T: ...
@overload
async def wait_until_async(predicate: Callable[[], T | Literal[False] | None], timeout: float,
                           step: float = ..., *, what: str = ...) -> T: ...
async def wait_until_async(predicate: Callable[[], object], timeout: float, step: float = 0.01, *,
                           what: str = "") -> object:
    """:func:`wait_until` inside an event loop: polls without blocking it; ``predicate`` may be async.

    Use it where the awaited state changes on the loop itself (a monitor's poll count, an
    event bus's delivery count), so a blocking wait would starve what it waits for.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout:g} s")
        await anyio.sleep(step)


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` where every connection is refused, for as long as the block runs.

    The port is bound but never listened on, so the kernel refuses connections to it and no
    other process can take it meanwhile (unlike a port found free and released).
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]


def announce_node(host: str, port: int, node_id: str, *, security: ClientSecurity | None = None,
                  timeout: float = 5.0) -> None:
    """Join the master at ``host:port`` as a client ``node_id`` and leave again at once (blocking).

    The master publishes ``node_joined`` for it and nothing when it leaves: a cheap event to
    trigger again and again until a subscriber shows it received one (its subscription is live).
    """
    from genie.types import NodeInfo, NodeRole
    from genie.wire import control
    from genie.wire.frame import MsgKind
    from genie.wire.handshake import connect_control

    async def run() -> None:
        with anyio.fail_after(timeout):
            stream = await connect_control(host, port, security or ClientSecurity(), role="client", node_id=node_id)
            async with stream:
                node = NodeInfo(node_id, socket.gethostname(), NodeRole.CLIENT)
                await control.request(stream, MsgKind.JOIN, {"node": node.to_dict()}, MsgKind.JOINED)
                await control.send_msg(stream, MsgKind.GOODBYE, {})

    anyio.run(run)


# -- plugins -------------------------------------------------------------------------------------

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


# -- events --------------------------------------------------------------------------------------

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


# -- servers -------------------------------------------------------------------------------------

#: The bare data-plane server process (``python -m genie.server``): ``.port``, ``.log()``, ``.alive()``, ``.process``.
ServerProcess = NodeProcess


@contextlib.contextmanager
def serve_subprocess(*args: str, ready_timeout: float = READY_TIMEOUT, log_level: str = "INFO",
                     env: dict[str, str] | None = None) -> Iterator[NodeProcess]:
    """Run ``python -m genie.server ARGS`` (a bare data-plane server) until its ready line; always stop it."""
    with NodeProcess.data_plane("--log-level", log_level, *args, env=env, ready_timeout=ready_timeout) as server:
        yield server


def shared_server_devices() -> str:
    """The ``--devices`` of a test session's shared servers: ``GENIE_TEST_SERVER_DEVICES`` or ``cpu,cpu``.

    Two logical devices, so tests reach ``remote_accelerator:0`` and ``:1``; on a GPU host
    ``GENIE_TEST_SERVER_DEVICES=cuda:0,cuda:0`` puts both on the GPU.
    """
    return os.environ.get("GENIE_TEST_SERVER_DEVICES", "").strip() or "cpu,cpu"


@pytest.fixture(scope="session")
def genie_serve() -> Iterator[NodeProcess]:
    """One data-plane server process (``--port 0``, :func:`shared_server_devices`) shared by a test session."""
    with serve_subprocess("--port", "0", "--devices", shared_server_devices()) as server:
        yield server


@pytest.fixture
def genie_inproc_server() -> Iterator[Callable[..., DataPlaneServer]]:
    """``start(devices=2, *, transport=None, hello_timeout=5.0, **options)`` -> a started in-process
    :class:`~genie.server.DataPlaneServer` on ``127.0.0.1`` port 0 with CPU devices.

    ``options`` are :class:`~genie.config.ClusterConfig` options (the environment is ignored);
    ``transport`` defaults to the installed ``tcp`` transport. Every server is stopped at teardown.
    """
    import torch

    from genie.config import ClusterConfig
    from genie.server import DataPlaneServer

    servers: list[DataPlaneServer] = []

    def start(devices: int = 2, *, transport: Transport | None = None, hello_timeout: float = 5.0,
              **options: Any) -> DataPlaneServer:
        chosen = transport if transport is not None else get_plugin_manager().transports()["tcp"]()
        server = DataPlaneServer(chosen, "127.0.0.1", 0, [torch.device("cpu")] * devices,
                                 ClusterConfig.from_sources({}, **options), hello_timeout=hello_timeout)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop(timeout=5)


# -- clusters ------------------------------------------------------------------------------------

class LocalCluster:
    """A ``genie serve`` master on port 0 and ``genie worker`` processes joined to it, on loopback.

    :param workers: the node ids of the workers to start with the master.
    :param devices: the ``--devices`` of every node.
    :param master_args: more ``genie serve`` arguments (``--metrics-port``, intervals...).
    :param worker_args: more ``genie worker`` arguments, for every worker.
    :param env: environment variables added for every node.

    A context manager; :meth:`stop` stops every node (also the ones a failed start left).
    """

    def __init__(self, workers: Iterable[str] = ("w1",), *, devices: str = "cpu", master_args: Iterable[str] = (),
                 worker_args: Iterable[str] = (), env: dict[str, str] | None = None,
                 ready_timeout: float = READY_TIMEOUT) -> None:
        self.worker_ids = tuple(workers)
        self.devices = devices
        self.master_args = tuple(master_args)
        self.worker_args = tuple(worker_args)
        self.env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.master: NodeProcess | None = None
        self.workers: dict[str, NodeProcess] = {}

    @property
    def port(self) -> int:
        """The master's control port (bound; known once started)."""
        if self.master is None:
            raise GenieError("LocalCluster.port is known only after start()")
        return self.master.control_port

    @property
    def master_addr(self) -> str:
        """``127.0.0.1:PORT`` of the master's control plane, as ``genie worker --master`` takes it."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> LocalCluster:
        """Start the master, then every worker, each until its ready line."""
        try:
            self.master = NodeProcess("serve", "--port", "0", "--devices", self.devices, "--node-id", "master",
                                      *self.master_args, env=self.env, ready_timeout=self.ready_timeout).start()
            for node_id in self.worker_ids:
                self.add_worker(node_id)
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self, node_id: str, *args: str) -> NodeProcess:
        """Start one more worker ``node_id`` (with ``worker_args`` and ``args``) until it is ready."""
        proc = NodeProcess("worker", "--master", self.master_addr, "--devices", self.devices, "--node-id", node_id,
                           *self.worker_args, *args, env=self.env, ready_timeout=self.ready_timeout)
        self.workers[node_id] = proc
        return proc.start()

    def worker(self, node_id: str) -> NodeProcess:
        """The worker process started as ``node_id``."""
        return self.workers[node_id]

    def nodes(self) -> list[NodeProcess]:
        """The master, then the workers in start order."""
        return ([self.master] if self.master is not None else []) + list(self.workers.values())

    def stop(self) -> None:
        """Stop every node, workers first (so none reports the master lost on the way out).

        The workers stop side by side (a node takes a second or more to shut down its session
        workers), then the master.
        """
        workers = list(reversed(self.workers.values()))
        if len(workers) > 1:
            stoppers = [threading.Thread(target=proc.stop, name=f"stop-{proc.node_id or 'worker'}", daemon=True)
                        for proc in workers]
            for thread in stoppers:
                thread.start()
            for thread in stoppers:
                thread.join()
        for proc in [*workers, *([self.master] if self.master else [])]:
            proc.stop()  # once more: nothing left to do for a stopped worker; the master now
            proc.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def genie_cluster() -> Iterator[Callable[..., LocalCluster]]:
    """``genie_cluster(workers=("w1",), **LocalCluster options)`` -> a started :class:`LocalCluster`;
    every cluster started is stopped at teardown."""
    clusters: list[LocalCluster] = []

    def start(workers: Iterable[str] = ("w1",), **options: Any) -> LocalCluster:
        cluster = LocalCluster(workers, **options)
        clusters.append(cluster)
        return cluster.start()

    yield start
    for cluster in clusters:
        cluster.stop()


# -- network namespaces --------------------------------------------------------------------------




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


def _link_running(ns: str, dev: str) -> bool:
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "dev", dev], capture_output=True, text=True,
                         timeout=20).stdout
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
    return "LOWER_UP" in flags and "state UP" in out


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
        # The kernel marks a veth running (carrier) a moment after `up`; libraries that list usable
        # interfaces (UCX) skip one that is not running yet, so wait for both ends.
        for ns, dev in ((ns_a, f"gv{tag}a"), (ns_b, f"gv{tag}b")):
            wait_until(functools.partial(_link_running, ns, dev), 5.0, 0.01, what=f"veth {dev} in {ns} to run")
        yield VethPair(ns_a, addr_a, ns_b, addr_b)
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def same_host_backends() -> list[str]:
    """The backends two genie processes on this host advertise, best first, from what is installed here.

    ``shm`` when genie-shm is installed; ``dpdk`` when genie-dpdk's data path can run (its shim
    built, DPDK's libraries present); ``tcp`` always. Tests that check selection use it instead of
    hard-coding which plugins the environment has.
    """
    import importlib.util

    names = ["shm"] if importlib.util.find_spec("genie_shm") else []
    if importlib.util.find_spec("genie_dpdk") is not None:
        from genie_dpdk import eal, engine

        libs = eal.find_libraries()
        if engine.shim_built() and libs["eal"] and libs["ethdev"]:
            names.append("dpdk")
    return [*names, "tcp"]


# -- client processes ------------------------------------------------------------------------------



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
