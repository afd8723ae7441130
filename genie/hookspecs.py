"""Every hook a genie plugin can implement.

A plugin is a module (or object) registered under the entry-point group
``genie``; it implements any of these functions decorated with
``@genie.hookimpl``. Hooks register *things*: asynchronous work lives in the
methods of those things, never in an async hook implementation (pluggy cannot
await, and a coroutine would be taken for a result). Core calls every hook with
keyword arguments through :class:`genie.plugins.PluginManager`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pluggy

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from genie.cluster.placement import Candidate
    from genie.config import ClusterConfig
    from genie.transport.base import Transport
    from genie.types import ClusterEvent, HealthResult, NodeInfo, ProbeResult

PROJECT_NAME = "genie"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@runtime_checkable
class HealthCheck(Protocol):
    """What ``genie_health_checks`` returns: a named, blocking check (any class with these two members)."""

    #: Unique among all checks of a node; the name the node's health report shows.
    name: str

    def check(self) -> HealthResult:
        """Run the check (blocking is fine: it runs in a worker thread, with a timeout)."""
        ...


@runtime_checkable
class EventSink(Protocol):
    """What ``genie_event_sinks`` returns: receives every cluster event, in order, on the bus's loop."""

    def handle(self, event: ClusterEvent) -> None:
        """Take one event; must return quickly (hand slow work to a thread or a queue)."""
        ...


@hookspec
def genie_transports() -> list[type[Transport]]:
    """Return the transport classes this plugin provides.

    Called once, when the plugin manager first builds its transport table
    (``genie.init()``, ``genie serve``, ``genie plugins``, ``genie discover``).

    :return: a list of classes implementing :class:`genie.transport.Transport`:
        each has a class attribute ``name`` (unique across plugins: two plugins
        claiming one name is an error naming both), a class attribute
        ``default_priority``, ``async probe(target) -> ProbeResult`` and the
        blocking ``connect``/``listen`` methods. Native libraries must be
        imported inside ``probe()``, so that a missing library is an
        "unavailable" result with a reason, not an ImportError.
    """


@hookspec(firstresult=True)
def genie_backend_priority(result: ProbeResult, config: ClusterConfig) -> int | None:
    """Override the rank of an available backend.

    Called once per available probe result while backends are ranked, on the
    runtime thread.

    :param result: the transport's probe result (its ``priority`` is the default rank).
    :param config: the cluster configuration in force.
    :return: an int that replaces ``result.priority`` (higher wins), or None to
        keep it.

    Stops at first non-None result, see :ref:`firstresult`.
    """


@hookspec
def genie_node_metrics(node: NodeInfo) -> dict[str, Any] | None:
    """Return a fragment of this node's metrics.

    Called every ``gpu_poll_interval`` by the resource monitor, in a worker
    thread (never on the event loop), so blocking libraries such as NVML are
    fine here.

    :param node: the local node being measured.
    :return: a dict fragment merged into the node's metrics snapshot, such as
        ``{"gpus": [ {...}, ... ]}`` or ``{"host": {"cpu_percent": ...}}``,
        or None when the plugin has nothing to say.
    """


@hookspec
def genie_health_checks() -> list[HealthCheck]:
    """Return health check objects.

    Called once when the health checker starts.

    :return: a list of :class:`HealthCheck` objects: a ``name`` attribute and a
        blocking ``check() -> HealthResult`` method. The checker runs each in a worker
        thread every ``health_check_interval`` with a timeout; a check that
        hangs or raises is itself reported as failing, never blocks the others.
    """


@hookspec
def genie_event_sinks() -> list[EventSink]:
    """Return event sinks.

    Called once when the event bus starts.

    :return: a list of :class:`EventSink` objects: a
        ``handle(event: ClusterEvent) -> None`` method. Each receives every event in order; a sink that raises is
        logged and never stops the others.
    """


@hookspec(firstresult=True)
def genie_placement_score(candidate: Candidate, default_score: float, min_memory: int | None,
                          prefer: str | int | None) -> float | None:
    """Score a device for new work: a site's own placement policy.

    Called by ``genie.device()`` (and by ``genie.init`` to choose the current
    device) on the client's thread, once per eligible device (its node connected,
    its session alive, not unhealthy, enough free memory), so keep it cheap.

    :param candidate: the device and what is known of it
        (:class:`genie.cluster.placement.Candidate`: index, node id, kind, free
        and total memory, utilisation, health grade, this client's share of data
        there, measured link round trip).
    :param default_score: genie's own score for it (docs/placement.md).
    :param min_memory: bytes the caller asked to have free, or None.
    :param prefer: what the caller prefers (a node id, index or kind), or None.
    :return: the device's score (higher wins; ``float("-inf")`` excludes it), or
        None to keep ``default_score``.

    Stops at first non-None result, see :ref:`firstresult`.
    """


@hookspec(firstresult=True)
def genie_resolve_master(address: str, timeout: float) -> tuple[str, int] | None:
    """Find the master behind an address with a scheme, such as ``ray://HOST:PORT``.

    Called when ``master_addr`` (an argument, ``GENIE_MASTER_ADDR`` or a tool's ``--master``)
    contains ``://``, once, on the calling thread, before anything connects; and by
    ``genie.init(NAME=True)`` with ``address="NAME://"`` (``genie.init(ray=True)``).

    :param address: the whole address as given, scheme included.
    :param timeout: seconds the lookup may take (the connect timeout).
    :return: the master's control plane as ``(host, port)``, or None when this plugin does not
        handle the address's scheme. Raise :class:`genie.errors.ConnectError` (or another
        GenieError) naming the problem when the scheme is yours but the master cannot be found.

    Stops at first non-None result, see :ref:`firstresult`.
    """


@hookspec
def genie_cli_commands() -> list[Callable[[argparse._SubParsersAction[Any]], None]]:
    """Return functions that add subcommands to the ``genie`` command.

    Called once, when ``genie`` builds its argument parser, after the core's own subcommands.

    :return: a list of ``register(subparsers)`` functions, each adding its parser(s) with
        ``subparsers.add_parser(...)`` and setting ``func`` (the parsed arguments in, an exit code
        out), as the core's subcommands do. A name the core or another plugin already uses is an
        error naming the plugin.
    """
