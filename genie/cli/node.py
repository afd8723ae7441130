"""``genie serve`` (the master) and ``genie worker`` (a node that joins a master).

Both run a genie runtime in the foreground: a data-plane server for this node's
devices and, for the master, the control service on ``--port``. They print one
ready line (see :mod:`genie.cluster.launch`) and stop cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from genie.cli.options import add_session_options, session_config
from genie.config import ClusterConfig, env_name

if TYPE_CHECKING:
    from genie.cluster.state import ClusterState

log = logging.getLogger("genie.node")

#: The environment variable behind ``genie serve --state-file``.
STATE_FILE_ENV = "GENIE_STATE_FILE"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; GENIE_BIND_ADDR)")
    p.add_argument("--data-port", type=int, default=None, help="data-plane port (default: any free port)")
    p.add_argument("--advertise-host", default=None,
                   help="the address others reach this node at, when it differs from --host (NAT, containers; "
                        "GENIE_ADVERTISE_HOST)")
    p.add_argument("--advertise-ports", default=None,
                   help="the data port others reach (a port), or per backend 'tcp=7000,shm=7001', when a port "
                        "mapping differs from what is bound (GENIE_ADVERTISE_PORTS)")
    p.add_argument("--backend", default=None, help="auto, a backend name, a list 'rdma,tcp' or exclusions '^dpdk'")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics (Prometheus), /healthz and /readyz on this port (default: off)")
    p.add_argument("--gpu-poll-interval", type=float, default=None)
    p.add_argument("--health-check-interval", type=float, default=None)
    p.add_argument("--heartbeat-interval", type=float, default=None)
    p.add_argument("--heartbeat-timeout", type=float, default=None)
    add_session_options(p)


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the master node (registry, control service, its own GPUs)")
    serve.add_argument("--port", type=int, default=None, help=f"control-plane port (default 5555; 0: any free port, shown in the ready line; "
                            f"{env_name('master_port')})")
    serve.add_argument("--state-file", default=None,
                       help="keep the cluster's device order in this file, so it survives a restart of the master "
                            f"(default: none; {STATE_FILE_ENV}); use it with a fixed --node-id")
    _common(serve)
    serve.set_defaults(func=run_serve)
    worker = sub.add_parser("worker", help="run a worker node that joins a master and serves its GPUs")
    worker.add_argument("--master", default=None,
                        help="HOST:PORT of the master's control plane (default: GENIE_MASTER_ADDR:GENIE_MASTER_PORT, "
                             "else 127.0.0.1:5555)")
    _common(worker)
    worker.set_defaults(func=run_worker)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``genie serve`` and ``genie worker`` add to the session options (genie.cli.options)."""
    return {
        "bind_addr": args.host, "data_port": args.data_port, "backend": args.backend,
        "advertise_host": args.advertise_host, "advertise_ports": args.advertise_ports,
        "heartbeat_interval": args.heartbeat_interval, "heartbeat_timeout": args.heartbeat_timeout,
        "metrics_port": args.metrics_port, "gpu_poll_interval": args.gpu_poll_interval,
        "health_check_interval": args.health_check_interval,
        "health_check_timeout": min(args.health_check_interval, 5.0) if args.health_check_interval else None,
    }


def run_serve(args: argparse.Namespace) -> int:
    state_file = args.state_file if args.state_file is not None else os.environ.get(STATE_FILE_ENV, "")
    return _run("server", args, {"master_port": args.port, **_options(args)}, state_file=state_file)


def run_worker(args: argparse.Namespace) -> int:
    from genie.cli._master import parse_master

    # --master wins; without it ClusterConfig reads GENIE_MASTER_ADDR / GENIE_MASTER_PORT.
    # A ``ray://...`` address is resolved by the runtime (genie_resolve_master).
    host, port = (parse_master(args.master) if args.master and "://" not in args.master
                  else (args.master, None))
    return _run("worker", args, {"master_addr": host, "master_port": port, **_options(args)})


def ready_line(role: str, config: ClusterConfig, state: ClusterState) -> str:
    """The line a launcher waits for, with the ports actually bound (``--port 0`` and ``--data-port 0``
    mean any free port): ``genie ROLE ready: control=HOST:PORT data=HOST:PORT devices=N node=ID
    [metrics=PORT]``. :data:`genie.cluster.launch.READY` parses it; it is logged as well."""
    control = f"{config.bind_addr}:{state.master_port or config.master_port}"
    if role == "worker":
        control = f"{config.master_addr}:{config.master_port}"
    line = (f"genie {role} ready: control={control} data={config.bind_addr}:{state.data_port} "
            f"devices={len(state.local_node.gpus)} node={state.local_node.node_id}")
    metrics_port = state.stats.get("metrics_port")
    if metrics_port:
        line += f" metrics={metrics_port}"
    if config.advertise_host or config.advertise_ports:
        line += f" advertised={state.local_node.address}:{state.local_node.data_port}"
    log.info("%s", line)
    return line


def _run(role: str, args: argparse.Namespace, options: dict[str, Any], *, state_file: str = "") -> int:
    from genie.security import check_exposure

    config = session_config(args, node_role=role, **options)
    check_exposure(config, insecure=config.insecure)  # fail before starting anything; the servers check again
    if config.isolation == "process":
        from genie.server.isolation import zygote

        zygote.start()  # the session workers' zygote imports torch beside this process's import of it
    from genie.cluster.runtime import Runtime

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    runtime = Runtime(config, state_file=state_file)
    state = runtime.start()
    try:
        if runtime.dataplane is not None:
            print(runtime.dataplane.isolation_summary, flush=True)
        print(ready_line(role, config, state), flush=True)
        stop.wait()
    finally:
        runtime.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
