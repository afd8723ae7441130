"""The plugin manager: entry points of group ``genie``, built-ins, typed hook calls.

Plugins are found through the entry-point group ``genie`` (``[project.entry-points.genie]``
``tcp = "genie_tcp"``). ``GENIE_PLUGINS=a,b`` loads only the named entry points,
``GENIE_DISABLE_PLUGIN_AUTOLOAD=1`` loads none (built-ins still load), and
``GENIE_TRACE_PLUGINS=1`` logs every hook call with its arguments and results
to the ``genie.plugins.trace`` logger. A plugin whose import fails is never
hidden: :class:`~genie.errors.PluginError` names it and chains its ImportError.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import attrs
import pluggy

from genie import hookspecs
from genie._version import __version__
from genie.errors import DuplicateTransportError, PluginError
from genie.hookspecs import EventSink, HealthCheck

if TYPE_CHECKING:
    from genie.config import ClusterConfig
    from genie.transport.base import Transport
    from genie.types import NodeInfo, ProbeResult

log = logging.getLogger("genie.plugins")
trace_log = logging.getLogger("genie.plugins.trace")

ENTRY_POINT_GROUP = "genie"

#: Modules of the core registered as plugins: built-in behaviour is itself a plugin.
BUILTIN_PLUGINS = ("genie.builtin",)


@attrs.frozen
class PluginRecord:
    """What the manager knows of one registered plugin."""

    name: str
    distribution: str
    version: str
    path: str
    builtin: bool


class PluginManager:
    """Owns a pluggy manager and offers one typed method per hook (keyword arguments only)."""

    def __init__(self, *, autoload: bool | None = None, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._environ = env
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self._transports: dict[str, type[Transport]] | None = None
        #: hook name -> per-plugin hook callers (see :meth:`_each_plugin`); rebuilt when plugins change
        self._callers: dict[str, list[tuple[str, pluggy.HookCaller]]] = {}
        #: transport name -> the plugin that offers it (filled by :meth:`transports`)
        self.transport_owners: dict[str, str] = {}
        if env.get("GENIE_TRACE_PLUGINS", "") not in ("", "0"):
            self._pm.trace.root.setwriter(lambda msg: trace_log.debug(msg.rstrip()))
            self._pm.enable_tracing()
        for module_name in BUILTIN_PLUGINS:
            module = __import__(module_name, fromlist=["_"])
            self.register(module, name=module_name, builtin=True)
        if autoload is None:
            autoload = env.get("GENIE_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
        if autoload:
            only = env.get("GENIE_PLUGINS", "").strip()
            self.load_entry_points(only={n.strip() for n in only.split(",") if n.strip()} or None)

    # -- loading ---------------------------------------------------------------------------
    def load_entry_points(self, only: set[str] | None = None) -> None:
        """Import and register every entry point of group ``genie`` (or only those named)."""
        from genie.plugin_cache import entry_points

        found = entry_points(ENTRY_POINT_GROUP, self._environ)
        names = {ep.name for ep in found}
        if only is not None:
            missing = only - names
            if missing:
                log.warning("GENIE_PLUGINS names plugins that are not installed: %s", ", ".join(sorted(missing)))
        for ep in sorted(found, key=lambda e: e.name):
            if only is not None and ep.name not in only:
                continue
            dist = ep.dist.name if ep.dist else "unknown distribution"
            if ep.name in self.records:
                if self.records[ep.name].distribution == dist:
                    continue  # already loaded
                raise PluginError(
                    f"plugin name {ep.name!r} is claimed by two distributions: "
                    f"{self.records[ep.name].distribution or 'unknown distribution'} and {dist}; "
                    "uninstall one of them"
                )
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} (entry point {ep.value!r} of {dist}) failed to import: "
                    f"{type(exc).__name__}: {exc}; fix or uninstall {dist}, or leave it out with GENIE_PLUGINS"
                ) from exc
            self.register(plugin, name=ep.name, distribution=ep.dist)

    def register(
        self, plugin: object, *, name: str, builtin: bool = False, distribution: Any = None
    ) -> None:
        """Register ``plugin`` under ``name``; its hooks take effect at once."""
        self._pm.register(plugin, name=name)
        dist_name = distribution.name if distribution is not None else ("genie" if builtin else "")
        version = distribution.version if distribution is not None else ""
        if builtin:
            version = __version__
        path = getattr(plugin, "__file__", "") or ""
        self.records[name] = PluginRecord(name, dist_name, version, path, builtin)
        self._transports = None
        self._callers.clear()

    def unregister(self, name: str) -> None:
        """Remove the plugin registered under ``name``."""
        self._pm.unregister(name=name)
        self.records.pop(name, None)
        self._transports = None
        self._callers.clear()

    def hooks_of(self, name: str) -> list[str]:
        """The hook names the plugin registered under ``name`` implements."""
        plugin = self._pm.get_plugin(name)
        callers = self._pm.get_hookcallers(plugin) or []
        return sorted(c.name for c in callers)

    # -- typed hook calls ---------------------------------------------------------------------
    def _each_plugin(self, hook_name: str) -> list[tuple[str, pluggy.HookCaller]]:
        """(plugin name, a hook caller for that plugin's implementation alone), in the order pluggy calls them.

        Going through pluggy one plugin at a time keeps per-plugin attribution (which plugin
        offered a transport, which one failed its metrics) while every call is still a pluggy
        hook call, traced under ``GENIE_TRACE_PLUGINS`` like the others.
        """
        if hook_name not in self._callers:
            impls = list(reversed(getattr(self._pm.hook, hook_name).get_hookimpls()))
            plugins = [impl.plugin for impl in impls]
            self._callers[hook_name] = [
                (impl.plugin_name,
                 self._pm.subset_hook_caller(hook_name, remove_plugins=[p for p in plugins if p is not impl.plugin]))
                for impl in impls
            ]
        return self._callers[hook_name]

    def transports(self) -> dict[str, type[Transport]]:
        """Every transport class by name; two plugins claiming a name raise DuplicateTransportError."""
        if self._transports is not None:
            return self._transports
        table: dict[str, type[Transport]] = {}
        owners: dict[str, str] = {}
        for plugin_name, call in self._each_plugin("genie_transports"):
            for classes in call():
                for cls in cast("list[type[Transport]]", classes or []):
                    name = getattr(cls, "name", None)
                    if not isinstance(name, str) or not name:
                        raise PluginError(f"plugin {plugin_name!r} offers a transport {cls!r} without a name")
                    if name in table:
                        raise DuplicateTransportError(
                            f"transport {name!r} is claimed by two plugins: {owners[name]!r} and "
                            f"{plugin_name!r}; uninstall one or limit loading with GENIE_PLUGINS"
                        )
                    table[name], owners[name] = cls, plugin_name
        self._transports = table
        self.transport_owners = owners
        return table

    def backend_priority(self, *, result: ProbeResult, config: ClusterConfig) -> int | None:
        """The first plugin's override of ``result``'s rank, or None (``genie_backend_priority``, firstresult)."""
        answer: int | None = self._pm.hook.genie_backend_priority(result=result, config=config)
        return answer

    def node_metrics(self, *, node: NodeInfo) -> list[dict[str, Any]]:
        """Each plugin's fragment. Implementations are called one by one, so one that raises costs
        only its own fragment (reported as ``{"errors": {plugin: reason}}``), not the whole poll."""
        fragments: list[dict[str, Any]] = []
        for plugin_name, call in self._each_plugin("genie_node_metrics"):
            try:
                answers: list[dict[str, Any] | None] = call(node=node)
            except Exception as exc:
                log.debug("genie_node_metrics of plugin %r failed", plugin_name, exc_info=True)
                fragments.append({"errors": {plugin_name: f"{type(exc).__name__}: {exc}"}})
                continue
            fragments.extend(fragment for fragment in answers if fragment)
        return fragments

    def placement_hook(self) -> Callable[..., float | None] | None:
        """The ``genie_placement_score`` caller, or None when no plugin implements it (default policy)."""
        caller = self._pm.hook.genie_placement_score
        return caller if caller.get_hookimpls() else None

    def resolve_master(self, *, address: str, timeout: float) -> tuple[str, int] | None:
        """The first plugin's ``(host, port)`` for a ``scheme://`` master address, or None
        (``genie_resolve_master``, firstresult)."""
        answer: tuple[str, int] | None = self._pm.hook.genie_resolve_master(address=address, timeout=timeout)
        return answer

    def cli_commands(self) -> list[tuple[str, Callable[..., None]]]:
        """(plugin name, ``register(subparsers)``) for every subcommand a plugin adds (``genie_cli_commands``)."""
        return [(plugin_name, register) for plugin_name, call in self._each_plugin("genie_cli_commands")
                for registers in call() for register in (registers or [])]

    def health_checks(self) -> list[HealthCheck]:
        """Every plugin's health checks (``genie_health_checks``), most recently registered plugin first."""
        return [c for checks in self._pm.hook.genie_health_checks() for c in (checks or [])]

    def event_sinks(self) -> list[EventSink]:
        """Every plugin's event sinks (``genie_event_sinks``), most recently registered plugin first."""
        return [s for sinks in self._pm.hook.genie_event_sinks() for s in (sinks or [])]


_default: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use from the environment."""
    global _default
    if _default is None:
        _default = PluginManager()
    return _default


def reset_plugin_manager() -> None:
    """Forget the process-wide manager, so the next use reloads plugins (for tests)."""
    global _default
    _default = None
