"""The genie runtime: one thread with its own anyio event loop that owns all background work.

``genie.init()`` builds a :class:`Runtime`, which runs the five phases (config,
local node, discovery, connect, monitoring) on that thread within the init
timeout, naming the phase that ran out of time. Afterwards the thread keeps the
control connection, heartbeats, failure handling and the op-stream idle flusher
going, so a user thread busy in a long torch call never delays a heartbeat.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.abc import ByteStream

from genie.cluster.events import EventBus
from genie.cluster.placement import ClusterFigures, Decision, candidates, choose
from genie.cluster.state import ClusterState
from genie.config import ClusterConfig
from genie.errors import AuthenticationError, ConnectError, GenieError, InitTimeoutError
from genie.plugins import PluginManager, get_plugin_manager
from genie.security import ClientSecurity, ServerSecurity
from genie.server.host import local_gpus
from genie.transport.base import ProbeTarget
from genie.transport.discovery import discover
from genie.transport.selection import select
from genie.types import ClusterEvent, EventType, NodeInfo, NodeRole
from genie.wire import control
from genie.wire.frame import MsgKind
from genie.wire.handshake import connect_control

if TYPE_CHECKING:
    from genie.server.node import DataPlaneServer

log = logging.getLogger("genie.runtime")


#: How often the runtime thread sends batches a user thread left waiting. Shorter costs the user's
#: thread GIL hand-offs on every wake-up (2 ms measured 2.5x slower round trips); 20 ms costs nothing.
FLUSH_INTERVAL = 0.02
#: The longest wait between two attempts to reach a master that went away; never longer than one
#: heartbeat interval (:func:`reconnect_backoffs`), so a node rejoins a restarted master well
#: within the grace the master gives it (one heartbeat timeout, docs/server.md "Master restarts").
RECONNECT_MAX_BACKOFF = 5.0


def master_unreachable(cfg: ClusterConfig, detail: str) -> ConnectError:
    from genie.cluster.query import master_unreachable as unreachable

    return unreachable(cfg.master_addr, cfg.master_port, detail,
                       "start one with `genie serve` or set master_addr/GENIE_MASTER_ADDR")


def merge_nodes(state: ClusterState, fresh: list[dict[str, Any]]) -> None:
    """Apply an ack's node entries: update known nodes (a restarted node may listen on a new data
    port), append new ones, and extend the device list with their devices (by cluster index)."""
    known = {n["node_id"]: n for n in state.nodes}
    devices = {d["index"]: d for d in state.devices}
    grown = False
    for entry in fresh:
        listed = entry.pop("devices", None)
        node = known.get(entry["node_id"])
        if node is None:
            state.nodes.append(entry)
            known[entry["node_id"]] = entry
        else:
            node.update(entry)
        for d in listed or ():
            if isinstance(d, dict) and isinstance(d.get("index"), int):
                if d["index"] in devices:
                    devices[d["index"]].update(d)  # its node's status
                else:
                    devices[d["index"]], grown = d, True
    if grown:
        # Rebound, never sorted in place: other threads read the list meanwhile (an in-place sort
        # shows them an empty list).
        state.devices = [devices[i] for i in sorted(devices)]


def reconnect_backoffs(heartbeat_interval: float) -> Iterator[float]:
    """The waits between attempts to reach the master: from 0.1 s, doubling, at most
    ``min(RECONNECT_MAX_BACKOFF, heartbeat_interval)``. A node that lost the master thus tries
    at least once per heartbeat interval, and the master's grace for a node it restored from
    its state file (one heartbeat timeout, always longer than the interval) covers the wait."""
    cap = min(RECONNECT_MAX_BACKOFF, heartbeat_interval)
    wait = min(0.1, cap)
    while True:
        yield wait
        wait = min(wait * 2, cap)


def make_node_id(role: NodeRole) -> str:
    return f"{socket.gethostname()}-{role.value}-{os.getpid()}"


class Runtime:
    """Owns the runtime thread and everything that runs on it."""

    def __init__(self, config: ClusterConfig, pm: PluginManager | None = None, *, state_file: str = "") -> None:
        self.config = config
        self.pm = pm or get_plugin_manager()
        self.bus = EventBus(pm=self.pm)
        self.phase = "config"
        self.state_file = state_file  #: the master's membership file (genie serve --state-file)
        # Security settings are built once, here, from the configuration given (token files and
        # certificates read once); every connection of this process uses them, never the environment.
        self.security = ClientSecurity.from_config(config)
        self.server_security = ServerSecurity.from_config(config) if config.node_role != NodeRole.CLIENT else None
        self.state: ClusterState | None = None
        self.dataplane: DataPlaneServer | None = None
        self.control_service: Any = None
        self.membership: Any = None
        self._portal_cm: AbstractContextManager[Any] | None = None
        self.portal: Any = None
        self._cancel: anyio.CancelScope | None = None
        self._control: ByteStream | None = None
        self._stopped = False
        self.table: Any = None
        self._tg: Any = None
        self._known_version: int = -1
        self.monitor: Any = None
        self.health: Any = None
        self.telemetry: Any = None
        self.metrics_server: Any = None
        self._background_future: Any = None
        self._growing = False  #: a thread is appending devices of late joiners
        #: (when, what the master reported): refreshed at most once per heartbeat interval by place()
        self._placement_view: tuple[float, ClusterFigures] = (0.0, ClusterFigures({}, {}))

    # -- lifecycle (called from user threads) ---------------------------------------------------
    def start(self) -> ClusterState:
        """Run init's phases on the runtime thread; blocking, bounded by ``config.timeout``."""
        started = time.perf_counter()
        if self.config.node_role != NodeRole.SERVER:
            # ``ray://...`` and other scheme addresses name a master a plugin finds (genie_resolve_master).
            self.config = self.config.resolve_master(self.pm)
        self._portal_cm = anyio.from_thread.start_blocking_portal(name="genie-runtime")
        self.portal = self._portal_cm.__enter__()
        try:
            state = self.portal.call(self._init, started)
            t = time.perf_counter()
            self.phase = "monitoring"
            remaining = started + self.config.timeout - t
            self._background_future, _ = self.portal.start_task(self._background, state)
            if time.perf_counter() - started > self.config.timeout:
                raise InitTimeoutError("monitoring", self.config.timeout, f"{remaining:.3f} s were left")
            state.phase_durations["monitoring"] = time.perf_counter() - t
            log.info("init phase monitoring took %.1f ms", state.phase_durations["monitoring"] * 1000)
            self.phase = "running"
        except BaseException:
            self.stop()
            raise
        return state

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every background task, close connections and the thread; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.portal is not None:
            try:
                self.portal.call(self._shutdown)
            except Exception:
                log.debug("runtime shutdown raised", exc_info=True)
        if self.table is not None:
            for conn in self.table.connections():
                try:
                    conn.close()
                except Exception:
                    pass
        if self.dataplane is not None:
            self.dataplane.stop()
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None

    # -- init (on the runtime thread) --------------------------------------------------------------
    async def _init(self, started: float) -> ClusterState:
        cfg = self.config
        durations: dict[str, float] = {}
        deadline = started + cfg.timeout

        def mark(phase: str, t0: float) -> float:
            durations[phase] = time.perf_counter() - t0
            log.info("init phase %s took %.1f ms", phase, durations[phase] * 1000)
            return time.perf_counter()

        t = time.perf_counter()
        durations["config"] = t - started
        try:
            with anyio.fail_after(max(deadline - time.perf_counter(), 0.001)):
                self.phase = "local_node"
                node = NodeInfo(
                    node_id=cfg.node_id or make_node_id(cfg.node_role),
                    hostname=socket.gethostname(),
                    role=cfg.node_role,
                    gpus=tuple(local_gpus(cfg.devices)) if cfg.node_role != NodeRole.CLIENT else (),
                )
                t = mark("local_node", t)
                self.phase = "discovery"
                target = ProbeTarget(cfg.master_addr if cfg.node_role != NodeRole.SERVER else "",
                                     cfg.master_port if cfg.node_role != NodeRole.SERVER else 0,
                                     min(cfg.probe_timeout, max(deadline - time.perf_counter(), 0.001)))
                found = await discover(self.pm, target)
                tcp = found.results.get("tcp")
                if target.host and tcp is not None and tcp.reason_code == "unreachable":
                    raise master_unreachable(cfg, tcp.reason)
                selection = select(found.results, pm=self.pm, config=cfg)
                node = NodeInfo(node.node_id, node.hostname, node.role, cfg.bind_addr, 0, node.gpus,
                                tuple(selection.names))
                state = ClusterState(cfg, node, backend=selection.best.name, probes=dict(found.results))
                self.state = state
                t = mark("discovery", t)
                self.phase = "connect"
                await self._connect(state, selection)
                mark("connect", t)
        except TimeoutError:
            raise InitTimeoutError(self.phase, cfg.timeout) from None
        state.phase_durations = durations
        return state

    async def _connect(self, state: ClusterState, selection: Any) -> None:
        cfg = self.config
        role = cfg.node_role
        if role in (NodeRole.SERVER, NodeRole.WORKER):
            from genie.server.host import parse_devices
            from genie.server.node import DataPlaneServer

            # Serve every candidate backend (the best on data_port), so each client gets the best both support.
            classes = self.pm.transports()
            transport, *also = (classes[name]() for name in selection.names)
            assert self.server_security is not None  # built for every serving role
            self.dataplane = DataPlaneServer(transport, cfg.bind_addr, cfg.data_port, parse_devices(cfg.devices),
                                             cfg.replace(node_id=state.local_node.node_id),
                                             security=self.server_security, also=also)
            await anyio.to_thread.run_sync(self.dataplane.start)
            from genie.server import node_answers  # torch.distributed: session workers find peers by membership

            node_answers.set_peer_resolver(node_answers.runtime_resolver(self, state))
            state.data_port = self.dataplane.port
            host, port, ports = cfg.announced_endpoint(self.dataplane.port, self.dataplane.data_ports,
                                                       primary=selection.names[0])
            state.local_node = NodeInfo(state.local_node.node_id, state.local_node.hostname, role, host,
                                        port, state.local_node.gpus, tuple(n for n in selection.names if n in ports),
                                        data_ports=ports, advertised=bool(cfg.advertise_host),
                                        incarnation=secrets.token_hex(8))
            self._make_monitors(state)
            supervisor = self.dataplane.supervisor
            if supervisor is not None:
                # A worker's join (the master's listening) sends clients here at once, and a session's start
                # waits for the zygote (a torch import: seconds on a loaded host), which must not eat their
                # handshake timeout. Half the init budget at most; past it the node goes on and sessions wait.
                if not await anyio.to_thread.run_sync(supervisor.wait_started, cfg.timeout / 2):
                    log.warning("the session-worker zygote is not up after %.1f s; going on without it", cfg.timeout / 2)
        if role == NodeRole.SERVER:
            from genie.cluster.master import ControlService
            from genie.cluster.membership import Membership

            assert self.server_security is not None
            self.membership = Membership(cfg.heartbeat_timeout, self_id=state.local_node.node_id,
                                         state_file=self.state_file)
            self.control_service = ControlService(
                self.membership, heartbeat_interval=cfg.heartbeat_interval, publish=self.bus.publish,
                recent_events=self.bus.recent, security=self.server_security, monitor=self.monitor,
                health=self.health, telemetry=self.telemetry, metrics_server=self.metrics_server,
                server_metrics=self.dataplane.metrics if self.dataplane is not None else None,
                insecure=cfg.insecure)
            if self.telemetry is not None:
                self.telemetry.watch_membership(self.membership)
            for event in self.membership.join(state.local_node):
                self.bus.publish(event)
            return
        snapshot = await self._join(state)
        self._apply_snapshot(state, snapshot)
        if role == NodeRole.CLIENT:
            # The client's side (genie.cluster.nodes) imports torch; a node's process imports none (genie.server.host).
            from genie.cluster.nodes import connect_devices, session_backend

            links: dict[str, float] = {}
            state.stats["links"] = links
            self.table = table = await anyio.to_thread.run_sync(
                lambda: connect_devices(self.pm, cfg, self.security, state, snapshot, self.bus.publish, links)
            )
            # The one place the backend in use is decided for a client: what its sessions negotiated
            # (discovery's choice for nodes that serve).
            state.backend = session_backend(table) or state.backend
            from genie.device import ensure_registered
            from genie.device.registration import prime_autograd
            from genie.device.registry import set_default_index, set_table

            ensure_registered()
            prime_autograd()  # done at import already, except on a host with a CUDA driver
            set_table(table)
            self._placement_view = (time.monotonic(), ClusterFigures.from_reply(snapshot))
            if len(table):
                try:
                    decision = self._decide(self._placement_view[1], None, None)
                except GenieError as exc:
                    log.warning("no device is fit for work yet: %s", exc)
                else:
                    set_default_index(decision.index)

    async def _join(self, state: ClusterState) -> dict[str, Any]:
        cfg = self.config
        try:
            stream = await connect_control(cfg.master_addr, cfg.master_port, self.security,
                                           role=cfg.node_role.value, node_id=state.local_node.node_id,
                                           connect_timeout=cfg.connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise master_unreachable(cfg, str(exc) or "timed out") from None
        self._control = stream
        return await control.request(stream, MsgKind.JOIN, {"node": state.local_node.to_dict()}, MsgKind.JOINED)

    def _apply_snapshot(self, state: ClusterState, snapshot: dict[str, Any]) -> None:
        state.nodes = list(snapshot.get("nodes", []))
        state.devices = list(snapshot.get("devices", []))

    # -- background work ---------------------------------------------------------------------------
    async def _background(self, state: ClusterState, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as scope:
            self._cancel = scope
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await tg.start(self.bus.run)
                if self.config.node_role != NodeRole.CLIENT:
                    await self._start_monitors(tg, state)
                if self.control_service is not None:
                    port = await tg.start(self.control_service.serve, self.config.bind_addr,
                                          self.config.master_port, tg)
                    state.master_port = port
                elif self.config.enable_heartbeat:
                    tg.start_soon(self._heartbeat_loop, state)
                if self.control_service is None:
                    tg.start_soon(self._relay_master_events)
                if self.table is not None:
                    tg.start_soon(self._flush_loop)
                task_status.started()

    def _make_monitors(self, state: ClusterState) -> None:
        """Resource monitor, health checker and telemetry of a node that serves devices (started later)."""
        from genie.cluster.health import HealthChecker
        from genie.cluster.monitor import ResourceMonitor
        from genie.telemetry import MetricsServer, Telemetry, otlp_configured

        cfg, node = self.config, state.local_node
        self.monitor = ResourceMonitor.from_config(cfg, pm=self.pm, node=node, bus=self.bus)
        self.health = HealthChecker.from_config(cfg, pm=self.pm, node_id=node.node_id, bus=self.bus)
        server_metrics = self.dataplane.metrics if self.dataplane is not None else None
        if cfg.enable_telemetry and (cfg.metrics_port or otlp_configured()):
            self.telemetry = Telemetry(node_id=node.node_id)
            self.telemetry.watch_node(monitor=self.monitor, server=server_metrics)
            self.telemetry.follow_health(self.bus)
        if self.telemetry is not None and cfg.metrics_port:
            self.metrics_server = MetricsServer(self.telemetry, host=cfg.bind_addr, port=cfg.metrics_port,
                                                ready=lambda: self.phase == "running")

    async def _start_monitors(self, tg: Any, state: ClusterState) -> None:
        if self.config.enable_gpu_monitoring:
            await tg.start(self.monitor.run)
        if self.config.enable_health_checks:
            await tg.start(self.health.run)
        if self.metrics_server is not None:
            await tg.start(self.metrics_server.run)
            state.stats["metrics_port"] = self.metrics_server.port

    async def _flush_loop(self) -> None:
        # Servers close sessions idle for their session_idle_timeout (told in WELCOME); a client that
        # holds tensors but sends nothing keeps its sessions with an empty batch well before that.
        while True:
            await anyio.sleep(FLUSH_INTERVAL)
            for conn in self.table.connections():
                if conn.lost is not None:
                    continue
                if conn.has_pending():
                    conn.try_flush()
                else:
                    idle = conn.limits.get("session_idle_timeout") or 0
                    if idle > 0:
                        conn.keepalive(min(60.0, idle / 3))

    async def _heartbeat_loop(self, state: ClusterState) -> None:
        backoffs = reconnect_backoffs(self.config.heartbeat_interval)
        while True:
            try:
                if self._control is None:
                    snapshot = await self._join(state)
                    self._apply_snapshot(state, snapshot)
                    self._known_version = -1  # a restarted master counts versions from scratch
                    backoffs = reconnect_backoffs(self.config.heartbeat_interval)
                    log.info("rejoined the master at %s:%d", self.config.master_addr, self.config.master_port)
                    if self.table is not None:
                        await anyio.to_thread.run_sync(self._reconnect_lost)
                # Only clients need the node list (to follow their sessions' nodes); -1 asks for it.
                known = None
                if self.table is not None:  # a lost session needs the list to find its node again
                    lost = any(c.lost is not None for c in self.table.connections())
                    known = -1 if lost else self._known_version
                stream = self._control
                assert stream is not None  # set by the rejoin above
                await control.send_msg(stream, MsgKind.HEARTBEAT,
                                       {"node_id": state.local_node.node_id, "metrics": self._metrics(),
                                        "known": known})
                with anyio.fail_after(self.config.heartbeat_timeout):
                    kind, ack = await control.recv_msg(stream)
                self._on_ack(state, ack)
                await anyio.sleep(self.config.heartbeat_interval)
            except (GenieError, OSError, TimeoutError) as exc:
                if self._control is not None:
                    log.warning("lost the master at %s:%d: %s", self.config.master_addr, self.config.master_port, exc)
                    await self._control.aclose()
                    self._control = None
                await anyio.sleep(next(backoffs))

    async def _relay_master_events(self) -> None:
        """Republish the master's events on this process's bus, so local subscribers see the cluster."""
        from genie.cluster.query import follow_events

        backoffs = reconnect_backoffs(self.config.heartbeat_interval)
        while True:
            try:
                async for event in follow_events(self.config.master_addr, self.config.master_port,
                                                 timeout=self.config.connect_timeout, security=self.security):
                    backoffs = reconnect_backoffs(self.config.heartbeat_interval)
                    self.bus.publish(event)
            except AuthenticationError as exc:
                # Not a passing outage: say so where people look, once per attempt at most every backoff.
                log.warning("the master refused this process's event stream: %s", exc)
            except (GenieError, OSError, TimeoutError) as exc:
                log.debug("event stream from the master ended: %s", exc)
            await anyio.sleep(next(backoffs))

    def _metrics(self) -> dict[str, Any]:
        """What a heartbeat carries: the latest metrics snapshot and health report."""
        from genie.cluster.monitor import node_report

        return node_report(self.monitor, self.health,
                           server_metrics=self.dataplane.metrics if self.dataplane is not None else None)

    def _on_ack(self, state: ClusterState, ack: dict[str, Any]) -> None:
        if "nodes" not in ack:
            return  # nothing changed since the version we applied
        self._known_version = ack.get("version", -1)
        fresh = [n for n in ack.get("nodes", []) if isinstance(n, dict) and isinstance(n.get("node_id"), str)]
        merge_nodes(state, fresh)
        if self.table is None:
            return
        from genie.cluster.nodes import restarted

        statuses = {n["node_id"]: n.get("status") for n in fresh}
        nodes = {n["node_id"]: n for n in fresh}
        for device in self.table.devices:
            status = statuses.get(device.node_id)
            if status in ("lost", "disconnected") and device.connection.lost is None:
                device.connection.mark_lost(f"the master declared node {device.node_id} {status}")
            elif status == "connected" and device.connection.lost is None and restarted(device.connection,
                                                                                       nodes[device.node_id]):
                # A new process rejoined under the node's id: this session (and a resume of it) is gone.
                device.connection.mark_lost(f"the master reports node {device.node_id} restarted (a new "
                                            "process rejoined under its id); the session's storages are gone")
            elif status == "connected" and device.connection.lost is not None:
                self._known_version = -1  # ask again next time, in case this attempt fails
                self._tg.start_soon(anyio.to_thread.run_sync, self._reconnect_lost)
                break
        if len(state.devices) > len(self.table) and not self._growing:
            self._growing = True
            self._tg.start_soon(anyio.to_thread.run_sync, self._add_devices)

    def _add_devices(self) -> None:
        """Append the devices of nodes that joined after init (a worker thread: opens sessions)."""
        from genie.cluster.nodes import add_devices

        try:
            # Until nothing is left: nodes listed while this thread was opening sessions come too.
            while add_devices(self.pm, self.config, self.security, self.state, self.table, self.bus.publish,
                              self.state.stats.get("links") if self.state is not None else None):
                pass
        except Exception:
            log.warning("could not add the devices of a new node", exc_info=True)
            self._known_version = -1
        finally:
            self._growing = False

    def _reconnect_lost(self) -> None:
        """Open new sessions to nodes that came back (old tensors stay lost)."""
        from genie.cluster.nodes import reconnect_lost

        reconnect_lost(self.pm, self.config, self.security, self.state, self.table, self.bus.publish)

    # -- placement (user threads) --------------------------------------------------------------------
    def _decide(self, view: ClusterFigures, min_memory: int | None, prefer: str | int | None) -> Decision:
        assert self.table is not None and self.state is not None
        decision = choose(candidates(self.table, view, self.state.stats.get("links", {})), pm=self.pm,
                          min_memory=min_memory, prefer=prefer)
        self.state.stats["last_placement"] = decision.event(self.state.local_node.node_id).data
        self.bus.publish(decision.event(self.state.local_node.node_id))
        return decision

    def place(self, *, min_memory: int | None = None, prefer: str | int | None = None) -> Decision:
        """Choose the device for new work from the master's latest figures (see genie.cluster.placement).

        The master's view is fetched at most once per heartbeat interval (one QUERY over this
        process's security settings); when the master is unreachable, the last view is used.
        """
        from genie.cluster.query import query_master

        when, view = self._placement_view
        if time.monotonic() - when > min(self.config.heartbeat_interval, 1.0):
            cfg = self.config
            try:
                reply = self.portal.call(lambda: query_master(cfg.master_addr, cfg.master_port,
                                                              timeout=cfg.connect_timeout, security=self.security))
                view = ClusterFigures.from_reply(reply)
                self._placement_view = (time.monotonic(), view)
            except (GenieError, OSError, TimeoutError) as exc:
                log.info("placement uses the master's figures from %.1f s ago: %s", time.monotonic() - when, exc)
        return self._decide(view, min_memory, prefer)

    async def _shutdown(self) -> None:
        if self._control is not None:
            try:
                with anyio.move_on_after(1.0):
                    await control.send_msg(self._control, MsgKind.GOODBYE, {})
                await self._control.aclose()
            except Exception:
                pass
            self._control = None
        if self._cancel is not None:
            self._cancel.cancel()

    def publish(self, event: ClusterEvent) -> None:
        self.bus.publish(event)


__all__ = ["Runtime", "make_node_id", "EventType"]
