"""genie-ray: a genie cluster on an existing Ray cluster.

Quick start
===========

On a machine of a running Ray cluster (``ray start --head`` ...)::

    pip install genie-ray
    genie ray up                     # master on the head node, one worker per GPU node
    python -c "import genie, torch; genie.init_sync(ray=True); print(torch.ones(2, device=genie.device()))"
    genie ray down                   # removes every actor and placement group it made

or from Python: ``genie_ray.up(...)``, ``genie_ray.status()``, ``genie_ray.down()``.
Clients find the master through Ray: ``genie.init(ray=True)`` (this machine's Ray cluster) or
``GENIE_MASTER_ADDR=ray://HOST:PORT`` (the Ray cluster's GCS address), optionally
``ray://HOST:PORT/NAME`` for a genie cluster started with ``--name``. Tensors flow straight
between clients and the workers' data planes; Ray only hosts the processes and tells the
master at once when a node or a worker actor dies. See docs/ray.md.

Importing this module does not import Ray: the plugin loads in every genie process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from genie import hookimpl

__all__ = ["up", "down", "status", "genie_resolve_master", "genie_cli_commands"]


def up(address: str | None = None, **options: Any) -> dict[str, Any]:
    """Start a genie cluster on the Ray cluster at ``address``: see :func:`genie_ray.cluster.up`."""
    from genie_ray.cluster import up as _up

    return _up(address, **options)


def down(address: str | None = None, **options: Any) -> dict[str, int]:
    """Remove the genie cluster from Ray: see :func:`genie_ray.cluster.down`."""
    from genie_ray.cluster import down as _down

    return _down(address, **options)


def status(address: str | None = None, **options: Any) -> dict[str, Any] | None:
    """The genie cluster in Ray, or None: see :func:`genie_ray.cluster.status`."""
    from genie_ray.cluster import status as _status

    return _status(address, **options)


@hookimpl
def genie_resolve_master(address: str, timeout: float) -> tuple[str, int] | None:
    """``ray://...``: the master actor's control plane, looked up by name in Ray."""
    if not address.startswith("ray://"):
        return None
    from genie_ray.cluster import lookup

    return lookup(address, timeout)


@hookimpl
def genie_cli_commands() -> list[Callable[[Any], None]]:
    """``genie ray up|down|status``."""
    from genie_ray.cli import register

    return [register]
