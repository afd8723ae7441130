"""What runs inside the Ray actors: the genie master and the genie workers.

Each actor hosts a real genie runtime in its own process, exactly what ``genie serve`` /
``genie worker`` run: the actor only gives that process a place in the Ray cluster. Clients
reach the master's control plane and every worker's data plane directly, by the addresses
the runtimes bound; Ray carries no tensor.

The master actor also watches Ray: a worker whose Ray node dies, or whose actor dies, is
declared lost in genie's membership at once (``ControlService.declare_lost``), not only after
genie's heartbeat timeout. With ``follow`` it keeps one worker on every matching Ray node,
nodes that join later included.

These classes are plain Python; :mod:`genie_ray.cluster` makes them Ray actors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import attrs

log = logging.getLogger("genie.ray")

#: Name of the master actor in the cluster's Ray namespace.
MASTER_NAME = "master"
#: Prefix of the worker actors' names (and, after "NAMESPACE:", of their placement groups).
WORKER_PREFIX = "worker-"
#: Seconds between a worker's looks at its raylet (its parent process).
FENCE_INTERVAL = 0.2
#: Seconds before a node where a worker failed to start is tried again (with ``follow``).
RETRY_AFTER = 30.0


def _node_ip() -> str:
    import ray.util

    return str(ray.util.get_node_ip_address())


def _runtime(role: str, spec: dict[str, Any], **options: Any) -> Any:
    """A started genie runtime of ``role`` (server or worker) with the spec's genie options."""
    from genie.cluster.runtime import Runtime
    from genie.config import ClusterConfig

    genie_options = {k: v for k, v in spec.get("genie", {}).items() if v is not None}
    # The actor's environment is Ray's, not the operator's: everything comes from the spec.
    config = ClusterConfig.from_sources({}, node_role=role, **genie_options, **options)
    runtime = Runtime(config)
    runtime.start()
    return runtime


@attrs.define
class WorkerRecord:
    """What the master knows of one worker actor."""

    node_id: str  #: the genie node id
    ray_node_id: str
    actor: Any
    placement_group: Any
    done: Any  #: the outstanding ``wait_stopped`` call: it finishes (with an error) when the actor dies
    info: dict[str, Any] = attrs.field(factory=dict)


class GenieWorker:
    """A genie worker node in a Ray actor: data plane for its devices, joined to the master."""

    def __init__(self, spec: dict[str, Any], master: tuple[str, int], node_id: str) -> None:
        import ray

        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.host = _node_ip()
        self.runtime = _runtime("worker", spec, master_addr=master[0], master_port=master[1], node_id=node_id,
                                bind_addr=self.host, devices=spec.get("devices", "auto"))
        self._stopped = threading.Event()
        threading.Thread(target=self._fence, args=(os.getppid(),), name="genie-ray-fence", daemon=True).start()

    def _fence(self, raylet: int) -> None:
        """Exit as soon as this node's raylet (the actor process's parent) dies: a process outliving its
        node must not serve on. No goodbye: Ray reports the death and the master declares the node
        lost with Ray's reason."""
        while not self._stopped.wait(FENCE_INTERVAL):
            if os.getppid() != raylet:
                log.warning("the raylet of %s died: the genie worker exits", self.runtime.config.node_id)
                os._exit(1)

    def info(self) -> dict[str, Any]:
        """The node id, where its data plane listens, its devices, its process and sessions opened so far."""
        state = self.runtime.state
        dataplane = self.runtime.dataplane
        return {"node_id": state.local_node.node_id, "ray_node_id": self.ray_node_id, "host": self.host,
                "data_port": state.data_port, "devices": len(state.local_node.gpus), "pid": os.getpid(),
                "sessions_opened": dataplane.metrics.sessions_opened if dataplane is not None else 0}

    def wait_stopped(self) -> bool:
        """Returns when :meth:`stop` ran; while the actor lives it never does (the master's death watch)."""
        self._stopped.wait()
        return True

    def stop(self) -> None:
        """Leave the cluster and stop serving (the actor itself is killed afterwards)."""
        if not self._stopped.is_set():
            self.runtime.stop()
            self._stopped.set()


class GenieMaster:
    """The genie master in a detached Ray actor, and the watch that feeds it Ray's failures."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray

        self.spec = spec
        self.namespace: str = spec["namespace"]
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.host = _node_ip()
        self.runtime = _runtime("server", spec, master_port=spec.get("port", 0), bind_addr=self.host,
                                node_id=f"ray-master-{self.ray_node_id[:12]}",
                                devices=spec.get("master_devices", "cpu"))
        self.port: int = self.runtime.state.master_port
        self._workers: dict[str, WorkerRecord] = {}
        #: genie node id -> when a worker that failed to start there may be tried again
        self._retry_after: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost: list[dict[str, Any]] = []  #: what the watch declared lost, with Ray's reason
        self._watch = threading.Thread(target=self._watch_loop, name="genie-ray-watch", daemon=True)
        self._watch.start()
        log.info("genie master in Ray at %s:%d", self.host, self.port)

    # -- answers ------------------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """Where the control plane listens: what ``ray://`` resolves to."""
        return self.host, self.port

    def pid(self) -> int:
        """This actor's process id (the genie master's process)."""
        return os.getpid()

    def workers(self) -> list[dict[str, Any]]:
        """Every live worker's :meth:`GenieWorker.info` as last read."""
        with self._lock:
            return [dict(r.info) for r in self._workers.values()]

    def lost_nodes(self) -> list[dict[str, Any]]:
        """The workers the watch declared lost: node id, Ray node id, reason, when."""
        with self._lock:
            return list(self.lost)

    # -- workers ----------------------------------------------------------------------------------------
    def ensure_workers(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Start a worker on every alive Ray node with the spec's resource that has none; wait until
        each serves and has joined. Returns every worker's info."""
        with self._lock:
            self._start_missing(timeout)
            return [dict(r.info) for r in self._workers.values()]

    def _worker_sets(self, node: dict[str, Any]) -> int:
        resource, per_worker = self.spec["resource"], self.spec.get("per_worker")
        have = float(node.get("Resources", {}).get(resource, 0))
        if have <= 0:
            return 0
        return int(have // per_worker) if per_worker else 1

    def _start_missing(self, timeout: float) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resource, per_worker = self.spec["resource"], self.spec.get("per_worker")
        pending: list[WorkerRecord] = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            ray_node = node["NodeID"]
            amount = per_worker or float(node.get("Resources", {}).get(resource, 0))
            for i in range(self._worker_sets(node)):
                node_id = f"ray-{ray_node[:12]}-{i}"
                if node_id in self._workers or self._retry_after.get(node_id, 0.0) > time.monotonic():
                    continue
                # One placement group per GPU set, pinned to its node: the set stays reserved for genie.
                bundle = {resource: amount}
                pg = placement_group([bundle], strategy="STRICT_PACK", name=f"{self.namespace}:{WORKER_PREFIX}{node_id}",
                                     lifetime="detached", bundle_label_selector=[{"ray.io/node-id": ray_node}])
                demand = {"num_gpus": amount} if resource == "GPU" else {"resources": bundle}
                actor = ray.remote(GenieWorker).options(
                    name=f"{WORKER_PREFIX}{node_id}", namespace=self.namespace, lifetime="detached", num_cpus=0,
                    max_restarts=0, max_concurrency=4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                    **demand,
                ).remote(self.spec, (self.host, self.port), node_id)
                pending.append(WorkerRecord(node_id, ray_node, actor, pg, None))
        deadline = time.monotonic() + timeout
        for record in pending:
            try:
                record.info = ray.get(record.actor.info.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except Exception as exc:
                log.warning("genie worker %s did not start on Ray node %s (tried again in %g s): %s",
                            record.node_id, record.ray_node_id, RETRY_AFTER, exc)
                self._retry_after[record.node_id] = time.monotonic() + RETRY_AFTER
                self._discard(record)
                continue
            record.done = record.actor.wait_stopped.remote()
            self._workers[record.node_id] = record
        self._wait_joined([r.node_id for r in pending if r.node_id in self._workers], deadline)

    def _wait_joined(self, node_ids: list[str], deadline: float) -> None:
        members = self.runtime.membership.members
        while node_ids and time.monotonic() < deadline:
            if all(n in members for n in node_ids):
                return
            self._stop.wait(0.02)

    def _discard(self, record: WorkerRecord) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.kill(record.actor)
        except Exception:
            log.debug("killing worker actor %s", record.node_id, exc_info=True)
        try:
            remove_placement_group(record.placement_group)
        except Exception:
            log.debug("removing the placement group of %s", record.node_id, exc_info=True)

    # -- the watch: Ray's failures into genie's membership ----------------------------------------------
    def _declare_lost(self, record: WorkerRecord, reason: str) -> None:
        service = self.runtime.control_service
        self.runtime.portal.call(service.declare_lost, record.node_id, reason)
        self.lost.append({"node_id": record.node_id, "ray_node_id": record.ray_node_id, "reason": reason,
                          "at": time.time()})
        del self._workers[record.node_id]
        self._discard(record)
        log.warning("genie node %s lost: %s", record.node_id, reason)

    def _check(self) -> None:
        import ray

        with self._lock:
            if not self._workers:
                return
            alive = {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
            for record in list(self._workers.values()):
                if not alive.get(record.ray_node_id, False):
                    self._declare_lost(record, f"Ray reports its node {record.ray_node_id[:12]} dead")
            records = {r.done: r for r in self._workers.values()}
        if not records:
            return
        ready, _ = ray.wait(list(records), num_returns=len(records), timeout=0)
        with self._lock:
            for ref in ready:
                record = records[ref]
                if record.node_id not in self._workers:
                    continue
                try:
                    ray.get(ref)
                    reason = "its Ray actor stopped"
                except Exception as exc:
                    reason = f"Ray reports its actor dead ({type(exc).__name__})"
                self._declare_lost(record, reason)

    def _watch_loop(self) -> None:
        interval = float(self.spec.get("poll_interval", 0.5))
        while not self._stop.wait(interval):
            try:
                self._check()
                if self.spec.get("follow"):
                    with self._lock:
                        self._start_missing(float(self.spec.get("start_timeout", 120.0)))
            except Exception:
                log.warning("the Ray watch failed once; it goes on", exc_info=True)

    # -- teardown ---------------------------------------------------------------------------------------
    def shutdown(self) -> int:
        """Stop the watch, every worker (leaving genie), their placement groups, then the master's
        runtime. Returns how many workers were stopped. The caller kills this actor afterwards."""
        import ray

        self._stop.set()
        self._watch.join(timeout=10)
        with self._lock:
            records = list(self._workers.values())
            self._workers.clear()
        for record in records:
            try:
                ray.get(record.actor.stop.remote(), timeout=10)
            except Exception:
                log.debug("stopping worker %s", record.node_id, exc_info=True)
            self._discard(record)
        self.runtime.stop()
        return len(records)
