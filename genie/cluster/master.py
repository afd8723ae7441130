"""The master's control service: joins, heartbeats, queries, event subscriptions.

Runs on the runtime thread's event loop. One task per control connection; a
malformed message closes that connection only. A sweeper declares silent nodes
lost and tells every subscriber.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from anyio.abc import ByteStream, SocketStream, TaskGroup

from genie.cluster.membership import Membership
from genie.cluster.monitor import node_report
from genie.cluster.report import NodeReport
from genie.errors import ConnectionClosedError, GenieError
from genie.security import ServerSecurity, check_bind
from genie.types import ClusterEvent, NodeInfo, NodeRole
from genie.wire import control
from genie.wire.frame import MsgKind
from genie.wire.handshake import accept_control

if TYPE_CHECKING:
    from genie.cluster.health import HealthChecker
    from genie.cluster.monitor import ResourceMonitor
    from genie.server.metrics import ServerMetrics
    from genie.telemetry import MetricsServer, Telemetry

log = logging.getLogger("genie.master")


class ControlService:
    """Serves the control plane on ``host:port`` for the master node."""

    def __init__(self, membership: Membership, *, heartbeat_interval: float, publish: Callable[[ClusterEvent], None],
                 security: ServerSecurity, recent_events: Callable[[], list[ClusterEvent]] | None = None,
                 monitor: ResourceMonitor | None = None, health: HealthChecker | None = None,
                 telemetry: Telemetry | None = None, metrics_server: MetricsServer | None = None,
                 server_metrics: ServerMetrics | None = None, insecure: bool = False) -> None:
        self.membership = membership
        self.heartbeat_interval = heartbeat_interval
        self.publish = publish
        self.recent_events = recent_events or (lambda: [])
        self.subscribers: set[Any] = set()
        self.port = 0
        self.monitor = monitor  #: the master's ResourceMonitor: ingests every node's heartbeat metrics
        self.health = health  #: the master's own HealthChecker
        self.telemetry = telemetry
        self.server_metrics = server_metrics  #: the master's own data plane (genie.server.metrics.ServerMetrics)
        self.metrics_server = metrics_server  #: where /metrics is served (None: nowhere)
        #: ack bodies per (version a client applied, current version): one build per membership change
        self._acks: dict[tuple[int, int], dict[str, Any]] = {}
        #: token and TLS every control connection must pass (genie.wire.handshake.accept_control)
        self.security = security
        #: serve a non-loopback address without a token (genie.security.check_bind, run in serve())
        self.insecure = insecure

    @property
    def metrics_port(self) -> int:
        """Where /metrics is served (0: nowhere)."""
        return self.metrics_server.port if self.metrics_server is not None else 0

    async def serve(self, host: str, port: int, task_group: TaskGroup, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` and serve; ConfigError for a non-loopback ``host`` without a token or ``insecure``."""
        check_bind(host, self.security, insecure=self.insecure, option="host", what="control plane")
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        self.membership.listening()  # restored nodes can rejoin from now: their grace starts here
        task_group.start_soon(self._sweep)
        task_status.started(self.port)
        async with listener:
            await listener.serve(self._handle, task_group=task_group)

    async def _sweep(self) -> None:
        step = min(self.heartbeat_interval, self.membership.heartbeat_timeout / 4, 1.0)
        while True:
            await anyio.sleep(step)
            self._refresh_self()
            for event in self.membership.sweep():
                await self.emit(event)

    def _refresh_self(self) -> None:
        """The master's own metrics and health, as its heartbeat would carry them."""
        me = self.membership.members.get(self.membership.self_id)
        if me is None:
            return
        me.report = NodeReport.from_dict(node_report(self.monitor, self.health, me.info.node_id,
                                                     server_metrics=self.server_metrics),
                                         node_id=me.info.node_id)

    async def emit(self, event: ClusterEvent) -> None:
        self.publish(event)
        for send in list(self.subscribers):
            try:
                with anyio.fail_after(1.0):
                    await send(event)
            except Exception:
                self.subscribers.discard(send)

    async def declare_lost(self, node_id: str, reason: str) -> bool:
        """Mark ``node_id`` lost at once on an outside failure detector's word (docs/server.md),
        telling every subscriber and, in their next heartbeat acknowledgement, every client.
        Runs on the master's runtime loop (``runtime.portal.call``). True if it was connected."""
        events = self.membership.mark_lost(node_id, reason)
        for event in events:
            await self.emit(event)
        return bool(events)

    async def _handle(self, raw: SocketStream) -> None:
        peer = raw.extra(anyio.abc.SocketAttribute.remote_address)
        peer_host = peer[0] if isinstance(peer, tuple) else str(peer)
        node_id: str | None = None
        accepted = await accept_control(raw, self.security, peer=f"{peer_host}:{peer[1]}" if isinstance(peer, tuple)
                                        else peer_host)
        if accepted is None:
            await raw.aclose()
            return
        async with accepted as stream:
            try:
                while True:
                    kind, body = await control.recv_msg(stream)
                    if kind == MsgKind.JOIN:
                        node_id = await self._join(stream, body, peer_host)
                    elif kind == MsgKind.HEARTBEAT:
                        sender = str(body.get("node_id", node_id))
                        report = self._report(sender, body.get("metrics"))
                        for event in self.membership.heartbeat(sender, report):
                            await self.emit(event)
                        if self.telemetry is not None:
                            self.telemetry.record_heartbeat(node_id=sender, direction="received")
                        if report is not None and report.snapshot is not None and self.monitor is not None:
                            self.monitor.ingest(sender, report.snapshot)
                        await control.send_msg(stream, MsgKind.HEARTBEAT_ACK, self._ack(body.get("known")))
                    elif kind == MsgKind.QUERY:
                        reply = self.membership.snapshot()
                        reply["events"] = [e.to_dict() for e in self.recent_events()]
                        reply["master"] = {"node_id": self.membership.self_id, "metrics_port": self.metrics_port,
                                           "heartbeat_interval": self.heartbeat_interval,
                                           "heartbeat_timeout": self.membership.heartbeat_timeout}
                        await control.send_msg(stream, MsgKind.QUERY_REPLY, reply)
                    elif kind == MsgKind.SUBSCRIBE:
                        await self._stream_events(stream)
                        return
                    elif kind == MsgKind.GOODBYE:
                        if node_id:
                            for event in self.membership.leave(node_id):
                                await self.emit(event)
                            node_id = None
                        return
                    else:
                        raise GenieError(f"unexpected control message {kind.name}")
            except ConnectionClosedError:
                pass
            except GenieError as exc:
                log.warning("control connection from %s closed: %s", peer_host, exc)
                try:
                    await control.send_msg(stream, MsgKind.ERROR, {"reason": str(exc)})
                except GenieError:
                    pass

    @staticmethod
    def _report(sender: str, metrics: Any) -> NodeReport | None:
        """The heartbeat's metrics, parsed once here; a malformed report is logged and dropped."""
        if metrics is None:
            return None
        try:
            return NodeReport.from_dict(metrics, node_id=sender)
        except GenieError as exc:
            log.warning("bad metrics from %s: %s", sender, exc)
            return None

    def _ack(self, known_version: Any) -> dict[str, Any]:
        """O(1) when the sender's view is current; else only the serving nodes changed since.

        Workers send ``known`` = None (they never need the list); clients send the version
        they last applied (-1: everything). Each entry carries the node's devices with their
        cluster indices, so a client appends the devices of a node that joined after it.
        An ack body is built once per (known, current) version pair.
        """
        version = self.membership.version
        if known_version is None or known_version == version:
            return {"version": version}
        since = known_version if isinstance(known_version, int) and 0 <= known_version < version else -1
        key = (since, version)
        body = self._acks.get(key)
        if body is None:
            if len(self._acks) > 256 or any(v != version for _, v in self._acks):
                self._acks.clear()
            nodes = [
                {"node_id": m.info.node_id, "status": m.status.value, "address": m.info.address,
                 "data_port": m.info.data_port, "data_ports": dict(m.info.data_ports), "role": m.info.role.value,
                 "advertised": m.info.advertised, "incarnation": m.info.incarnation,
                 "backends": list(m.info.backends),
                 "devices": m.devices()}
                for m in self.membership.changed_since(since)
            ]
            body = self._acks[key] = {"version": version, "nodes": nodes, "full": since < 0}
        return body

    async def _join(self, stream: ByteStream, body: dict[str, Any], peer_host: str) -> str:
        try:
            info = NodeInfo.from_dict(body["node"])
        except (KeyError, TypeError, ValueError) as exc:
            raise GenieError(f"JOIN without a valid node description: {exc}") from None
        if info.role != NodeRole.CLIENT and info.address in ("", "0.0.0.0", "::"):
            info = attrs.evolve(info, address=peer_host)
        for event in self.membership.join(info):
            await self.emit(event)
        # Clients need the whole view (nodes, devices, figures for placement); a worker never reads it,
        # and building it is O(members): at 1,000 members, 15 ms of the master's time per worker join.
        reply: dict[str, Any] = (self.membership.snapshot() if info.role == NodeRole.CLIENT
                                 else {"version": self.membership.version})
        reply["heartbeat_interval"] = self.heartbeat_interval
        reply["heartbeat_timeout"] = self.membership.heartbeat_timeout
        await control.send_msg(stream, MsgKind.JOINED, reply)
        log.info("%s %s joined from %s", info.role.value, info.node_id, peer_host)
        return info.node_id

    async def _stream_events(self, stream: ByteStream) -> None:
        send_stream, receive_stream = anyio.create_memory_object_stream[ClusterEvent](1000)

        async def push(event: ClusterEvent) -> None:
            send_stream.send_nowait(event)

        self.subscribers.add(push)
        try:
            async with receive_stream:
                async for event in receive_stream:
                    await control.send_msg(stream, MsgKind.EVENT, event.to_dict())
        finally:
            self.subscribers.discard(push)
