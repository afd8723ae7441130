"""The driver side: ``up``, ``down``, ``status`` and the ``ray://`` master lookup.

Every call connects to the Ray cluster as a driver (``ray.init(address=...)``) unless this
process already is one, and disconnects again when it connected itself. The genie cluster
lives in its own Ray namespace (``name``, default ``genie``): the detached master actor
``master``, one detached worker actor ``worker-<node>`` and one detached placement group
``<name>:worker-<node>`` per GPU set; nothing else, so ``down`` removes exactly those.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from genie.errors import ConfigError, ConnectError, GenieError
from genie_ray.actors import MASTER_NAME, WORKER_PREFIX, GenieMaster

log = logging.getLogger("genie.ray")

#: The Ray namespace (and name) of a genie cluster when none is given.
DEFAULT_NAME = "genie"
SCHEME = "ray://"
#: genie options genie-ray sets for each actor itself (its role, address, id, ports, devices).
PER_ACTOR = frozenset({"node_role", "master_addr", "master_port", "bind_addr", "node_id", "data_port", "devices"})


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise GenieError(f"genie-ray needs Ray: pip install 'ray[default]>=2.49' ({exc})") from None
    return ray


@contextmanager
def connected(address: str | None, namespace: str) -> Iterator[Any]:
    """This process as a driver of the Ray cluster at ``address`` ("auto": the local one, or
    RAY_ADDRESS); an existing connection is reused and left open."""
    ray = _ray()
    if ray.is_initialized():
        yield ray
        return
    try:
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False,
                 logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConnectError(f"cannot reach the Ray cluster at {address or 'auto'}: {exc}; start one with "
                           "`ray start --head` or pass its address (ray://HOST:PORT, --address)") from None
    try:
        yield ray
    finally:
        ray.shutdown()


@attrs.frozen
class RayAddress:
    """A parsed ``ray://[HOST:PORT][/NAME]``: the Ray cluster's address and the genie cluster's name."""

    ray_address: str | None
    name: str

    @classmethod
    def parse(cls, text: str) -> RayAddress:
        if not text.startswith(SCHEME):
            raise ConfigError("master_addr", text, "argument master_addr", "ray://[HOST:PORT][/NAME]")
        rest = text[len(SCHEME):]
        where, _, name = rest.partition("/")
        if where in ("", "auto"):
            where = ""
        elif ":" not in where or not where.rpartition(":")[2].isdigit():
            raise ConfigError("master_addr", text, "argument master_addr",
                              "ray://HOST:PORT (the Ray cluster's GCS address, as `ray start --head` prints it), "
                              "ray://auto or ray:// (this machine's Ray cluster), each optionally /NAME")
        return cls(where or None, name or DEFAULT_NAME)


def _master(ray: Any, name: str) -> Any | None:
    try:
        return ray.get_actor(MASTER_NAME, namespace=name)
    except ValueError:
        return None


def lookup(address: str, timeout: float) -> tuple[str, int]:
    """The control plane of the genie master running in the Ray cluster ``address`` names."""
    where = RayAddress.parse(address)
    with connected(where.ray_address, where.name) as ray:
        master = _master(ray, where.name)
        if master is None:
            raise ConnectError(f"no genie master in the Ray cluster at {where.ray_address or 'auto'} "
                               f"(namespace {where.name!r}); start one with `genie ray up`")
        try:
            host, port = ray.get(master.address.remote(), timeout=timeout)
        except Exception as exc:
            raise ConnectError(f"the genie master actor in Ray namespace {where.name!r} did not answer within "
                               f"{timeout:g} s: {exc}") from None
    return str(host), int(port)


def up(address: str | None = None, *, name: str = DEFAULT_NAME, resource: str = "GPU",
       per_worker: float | None = None, devices: str = "auto", master_devices: str = "cpu", port: int = 0,
       follow: bool = True, poll_interval: float = 0.5, timeout: float = 180.0,
       **genie_options: Any) -> dict[str, Any]:
    """Start (or complete) a genie cluster on the Ray cluster at ``address``.

    The master runs as the detached actor ``master`` of Ray namespace ``name`` on Ray's head
    node; one worker actor runs per set of ``per_worker`` units of ``resource`` on every Ray
    node that has it (default: all of a node's GPUs, one worker per node), each in a placement
    group pinned to its node. Calling it again starts workers only where they are missing.

    :param resource: the Ray resource a worker reserves: ``GPU``, or a custom resource for nodes
        without GPUs (their workers then serve ``devices``, such as ``cpu``).
    :param devices: what each worker serves (``auto``: the GPUs Ray gave the actor).
    :param master_devices: what the master itself serves (its data plane always has one device).
    :param follow: keep one worker on every matching node, nodes that join later included.
    :param poll_interval: seconds between the master's looks at Ray's node table.
    :param genie_options: genie options for every node (``auth_token``, ``heartbeat_interval``,
        ``heartbeat_timeout``, ``insecure``, ``backend``, ...; see genie.config).
    :return: ``{"master": (host, port), "workers": [info, ...], "name": name}``.
    """
    from genie.config import ClusterConfig, option_names

    unknown = sorted(set(genie_options) - set(option_names()))
    if unknown:
        raise ConfigError(unknown[0], genie_options[unknown[0]], f"argument {unknown[0]}",
                          "one of genie's options: " + ", ".join(option_names()))
    reserved = sorted(set(genie_options) & PER_ACTOR)
    if reserved:
        raise ConfigError(reserved[0], genie_options[reserved[0]], f"argument {reserved[0]}",
                          "nothing: genie-ray sets it for each actor (use port=, devices=, master_devices=)")
    # Validated here, where a mistake is cheap to report, not in a Ray actor's constructor.
    ClusterConfig.from_sources({}, node_role="worker", devices=devices, **genie_options)
    ClusterConfig.from_sources({}, node_role="server", devices=master_devices, **genie_options)
    if per_worker is not None and per_worker <= 0:
        raise ConfigError("per_worker", per_worker, "argument per_worker", "a positive amount of the resource")
    spec = {"namespace": name, "resource": resource, "per_worker": per_worker, "devices": devices,
            "master_devices": master_devices, "port": port, "follow": follow, "poll_interval": poll_interval,
            "start_timeout": timeout, "genie": genie_options}
    with connected(address, name) as ray:
        master = ray.remote(GenieMaster).options(
            name=MASTER_NAME, namespace=name, lifetime="detached", get_if_exists=True, num_cpus=0,
            max_restarts=0, max_concurrency=4, resources={"node:__internal_head__": 0.001},
        ).remote(spec)
        try:
            host, port_bound = ray.get(master.address.remote(), timeout=timeout)
            workers = ray.get(master.ensure_workers.remote(timeout), timeout=timeout + 10)
        except Exception as exc:
            raise GenieError(f"the genie master did not start in Ray namespace {name!r}: {exc}") from None
    if not workers:
        log.warning("no Ray node has the resource %r: the genie cluster has only the master's devices", resource)
    return {"name": name, "master": (host, port_bound), "workers": workers}


def status(address: str | None = None, *, name: str = DEFAULT_NAME) -> dict[str, Any] | None:
    """The genie cluster in Ray namespace ``name``: master address, workers, nodes declared lost;
    None when there is none."""
    with connected(address, name) as ray:
        master = _master(ray, name)
        if master is None:
            return None
        host, port = ray.get(master.address.remote(), timeout=30)
        return {"name": name, "master": (host, port), "workers": ray.get(master.workers.remote(), timeout=30),
                "lost": ray.get(master.lost_nodes.remote(), timeout=30)}


def down(address: str | None = None, *, name: str = DEFAULT_NAME, timeout: float = 60.0) -> dict[str, int]:
    """Remove the genie cluster of Ray namespace ``name``: workers (leaving genie first), their
    placement groups, the master. Leftovers of a master that died are removed too.
    Returns how many actors and placement groups were removed."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    actors = groups = 0
    with connected(address, name) as ray:
        master = _master(ray, name)
        if master is not None:
            try:
                ray.get(master.shutdown.remote(), timeout=timeout)
            except Exception as exc:
                log.warning("the genie master did not shut down cleanly (%s); killing what is left", exc)
            ray.kill(master)
            actors += 1
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == name and entry["name"].startswith(WORKER_PREFIX):
                try:
                    ray.kill(ray.get_actor(entry["name"], namespace=name))
                    actors += 1
                except ValueError:
                    pass  # gone meanwhile
        for pg_id, entry in placement_group_table().items():
            if entry.get("name", "").startswith(f"{name}:{WORKER_PREFIX}") and entry.get("state") != "REMOVED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
                groups += 1
    return {"actors": actors, "placement_groups": groups}
