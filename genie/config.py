"""Cluster configuration: arguments and ``GENIE_*`` environment, validated, frozen.

Every option can come from a keyword argument or from the environment variable
``GENIE_<OPTION>`` (``GENIE_MASTER_PORT`` for ``master_port``); arguments win.
A bad value raises :class:`~genie.errors.ConfigError` naming the option, the
value, its source and what is allowed.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from genie.errors import ConfigError
from genie.types import NodeRole

if TYPE_CHECKING:
    from genie.plugins import PluginManager

_BACKEND_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@attrs.frozen
class BackendSpec:
    """A parsed ``backend`` option.

    ``auto``: every available backend, best first. ``rdma``: only that one.
    ``rdma,tcp``: those, in that order. ``^dpdk`` or ``^dpdk,rdma``: every
    backend except those. ``explicit`` is True when the user named backends,
    in which case genie never falls back to one they did not name.
    """

    text: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def explicit(self) -> bool:
        return bool(self.include)

    @classmethod
    def parse(cls, text: str, *, source: str = "argument backend") -> BackendSpec:
        raw = text.strip().lower()
        allowed = "'auto', a backend name, an ordered list like 'rdma,tcp', or exclusions like '^dpdk'"
        if raw in ("", "auto"):
            return cls("auto")
        negate = raw.startswith("^")
        names = tuple(n.strip() for n in (raw[1:] if negate else raw).split(","))
        for name in names:
            if not _BACKEND_NAME.match(name) or name == "auto":
                raise ConfigError("backend", text, source, allowed)
        if len(set(names)) != len(names):
            raise ConfigError("backend", text, source, allowed + " (each name once)")
        return cls(raw, exclude=names) if negate else cls(raw, include=names)

    def check_known(self, known: set[str], *, source: str = "argument backend") -> None:
        """Raise ConfigError if the spec names a backend no installed plugin provides."""
        for name in self.include + self.exclude:
            if name not in known:
                raise ConfigError(
                    "backend", self.text, source, f"installed backends: {', '.join(sorted(known)) or 'none'}"
                )


def _positive(value: float) -> bool:
    return value > 0


def _port_map_or_none(text: str) -> dict[str, int] | None:
    """``advertise_ports`` read: ``{}`` (empty), ``{"": port}`` (the data port), ``{backend: port}``; None if malformed."""
    text = text.strip()
    if not text:
        return {}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, port = part.strip().rpartition("=")
        if (sep and not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", name)) or not port.isdigit() \
                or not 0 < int(port) <= 65535 or name in out or (not sep and text.count(",")):
            return None
        out[name] = int(port)
    return out


_PORT_TEXT = "an integer port from 1 to 65535 (0: any free port, for the master itself only)"

# name -> (type, default, validator or None, allowed text)
_OPTIONS: dict[str, tuple[type, Any, Any, str]] = {
    "master_addr": (str, "127.0.0.1", lambda v: bool(v.strip()), "a host name or IP address"),
    "master_port": (int, 5555, lambda v: 0 <= v <= 65535,
                    _PORT_TEXT),
    "node_id": (str, "", lambda v: re.fullmatch(r"[A-Za-z0-9_.:-]{0,128}", v) is not None,
                "letters, digits, '_', '.', ':' or '-' (at most 128), or empty for a generated id"),
    "node_role": (str, "client", lambda v: v in {r.value for r in NodeRole}, "client, server or worker"),
    "backend": (str, "auto", None, "see BackendSpec"),
    "bind_addr": (str, "127.0.0.1", lambda v: bool(v.strip()), "an address to listen on"),
    "data_port": (int, 0, lambda v: 0 <= v <= 65535, "0 (any free port) or a port up to 65535"),
    # behind NAT or a container's port mapping (docs/network.md)
    "advertise_host": (str, "", lambda v: v == v.strip() and " " not in v,
                       "a host name or IP address others reach this node at, or empty (the bind address)"),
    "advertise_ports": (str, "", lambda v: _port_map_or_none(v) is not None,
                        "empty, a port (the data port others reach), or backend=port pairs like 'tcp=7000,shm=7001'"),
    "metrics_port": (int, 0, lambda v: 0 <= v <= 65535,
                     "0 (no metrics endpoint) or the port for /metrics, /healthz and /readyz"),
    "devices": (str, "auto", lambda v: re.fullmatch(r"auto|(cpu|cuda(:\d+)?)(,(cpu|cuda(:\d+)?))*", v) is not None,
                "'auto' or a list like 'cpu,cpu' or 'cuda:0,cuda:1'"),
    "heartbeat_interval": (float, 10.0, _positive, "a positive number of seconds"),
    "heartbeat_timeout": (float, 60.0, _positive, "a positive number of seconds, longer than heartbeat_interval"),
    "gpu_poll_interval": (float, 5.0, _positive, "a positive number of seconds"),
    "health_check_interval": (float, 30.0, _positive, "a positive number of seconds"),
    "health_check_timeout": (float, 5.0, _positive, "a positive number of seconds"),
    "timeout": (float, 30.0, _positive, "a positive number of seconds (the whole of init)"),
    "connect_timeout": (float, 5.0, _positive, "a positive number of seconds"),
    "probe_timeout": (float, 2.0, _positive, "a positive number of seconds"),
    "op_timeout": (float, 60.0, _positive, "a positive number of seconds a sync point may wait"),
    "enable_heartbeat": (bool, True, None, "true or false"),
    "enable_gpu_monitoring": (bool, True, None, "true or false"),
    "enable_health_checks": (bool, True, None, "true or false"),
    "enable_telemetry": (bool, True, None, "true or false"),
    "log_level": (str, "INFO", lambda v: v.upper() in _LOG_LEVELS, ", ".join(_LOG_LEVELS)),
    "auth_token": (str, "", None, "any string; empty disables authentication"),
    "max_session_bytes": (int, 0, lambda v: v >= 0, "0 (unbounded) or a byte count"),
    "max_session_handles": (int, 1_000_000, lambda v: v > 0, "a positive count"),
    "max_frame_bytes": (int, 8 << 30, lambda v: v >= 4096, "a byte count of at least 4096"),
    # security (see docs/SECURITY.md and genie/security.py)
    "auth_token_file": (str, "", None, "a path to a file holding the cluster token (not world-readable), or empty"),
    "tls_cert": (str, "", None, "a PEM certificate file (this node's), or empty for no TLS"),
    "tls_key": (str, "", None, "the PEM private key of tls_cert, or empty (the key is in tls_cert)"),
    "tls_ca": (str, "", None, "a PEM CA bundle that peers' certificates must chain to, or empty"),
    "tls_require_client_cert": (bool, False, None, "true or false (mutual TLS: servers demand client certificates)"),
    "max_op_elements": (int, (1 << 31) - 1, lambda v: v >= 0, "0 (unbounded) or a count of elements one op may "
                        "iterate over or produce"),
    "max_session_inflight": (int, 65536, lambda v: v > 0, "a positive count of commands and uploads per batch"),
    "session_idle_timeout": (float, 3600.0, lambda v: v >= 0, "seconds a silent session lives (0: forever)"),
    "reconnect_window": (float, 30.0, lambda v: v >= 0, "seconds a session waits for its client to reconnect "
                         "after its connection dropped (0: no resume; the session ends at once)"),
    # before authentication (see docs/SECURITY.md and genie/server/preauth.py)
    "handshake_timeout": (float, 10.0, _positive, "a positive number of seconds from accept to the end of "
                          "the handshake"),
    "max_preauth_per_source": (int, 32, lambda v: v > 0, "a positive count of connections from one address "
                               "that have not authenticated yet"),
    "max_preauth": (int, 512, lambda v: v > 0, "a positive count of connections that have not authenticated yet"),
    "max_sessions": (int, 1024, lambda v: v > 0, "a positive count of authenticated sessions open at once"),
    "insecure": (bool, False, None, "true or false (serve a non-loopback address without a cluster token)"),
    # the weight cache (see docs/server.md, docs/device.md and genie/server/content.py)
    "cache_bytes": (int, 1 << 30, lambda v: v >= 0, "0 (no weight cache) or a byte count of host memory"),
    "share_cache": (bool, False, None, "true or false (one weight cache scope for every client of the token)"),
    "upload_cache": (str, "params", lambda v: v in ("off", "params", "all"),
                     "off, params (parameters and tensors that require grad) or all"),
    # compression where the link is slow (see docs/network.md and genie/device/compression.py)
    "compression": (str, "auto", lambda v: v in ("auto", "off", "zstd"),
                    "auto (compress large transfers when the link measures below compression_below_mbit), off, or "
                    "zstd (always; needs the zstandard package on both ends)"),
    "compression_below_mbit": (float, 100.0, _positive, "a positive link bandwidth in Mbit/s below which auto "
                               "compresses"),
    "compression_min_bytes": (int, 256 << 10, lambda v: v >= 0, "a byte count from which a transfer is compressed"),
    # session isolation (see docs/SECURITY.md and genie/server/isolation/)
    "cuda_mps": (bool, False, None, "true or false (session workers share each GPU through the host's CUDA MPS "
                 "daemon; see genie/server/mps.py)"),
    "isolation": (str, "process", lambda v: v in ("process", "none"),
                  "process (each session in its own worker process) or none (sessions in threads, one trusted user)"),
    "op_deadline": (float, 300.0, _positive, "a positive number of seconds one op may run before its session "
                    "worker is killed"),
    "compile_replays": (str, "off", lambda v: v in ("off", "inductor"),
                        "off (replayed graphs run node by node) or inductor (an admitted replay's graph is compiled "
                        "by inductor on the node; see genie/server/inductor_replays.py)"),
    "profile_sessions": (str, "", None, "'' (off) or a directory where each session worker writes its torch.profiler "
                         "profile (isolation = process only; see genie/server/profiles.py)"),
    "worker_memory_overhead": (int, 2 << 30, lambda v: v >= 0, "a byte count a session worker may hold beyond "
                               "max_session_bytes (its cgroup's memory.max)"),
    "worker_cpu_weight": (int, 100, lambda v: 1 <= v <= 10000, "a cgroup cpu.weight from 1 to 10000"),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, kind: type, value: Any, source: str, allowed: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(name, value, source, allowed)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(name, value, source, allowed)
        return value
    # A bool is an int, and int(5555.5) would silently drop the fraction.
    if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise ConfigError(name, value, source, allowed)
    try:
        return kind(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ConfigError(name, value, source, allowed) from None


def env_name(option: str) -> str:
    """The environment variable that sets ``option``."""
    return "GENIE_" + option.upper()


@attrs.frozen
class ClusterConfig:
    """Every option of a genie node or client, validated. Build with :meth:`from_sources`."""

    master_addr: str
    master_port: int
    node_id: str
    node_role: NodeRole
    backend: BackendSpec
    bind_addr: str
    data_port: int
    advertise_host: str
    advertise_ports: str
    metrics_port: int
    devices: str
    heartbeat_interval: float
    heartbeat_timeout: float
    gpu_poll_interval: float
    health_check_interval: float
    health_check_timeout: float
    timeout: float
    connect_timeout: float
    probe_timeout: float
    op_timeout: float
    enable_heartbeat: bool
    enable_gpu_monitoring: bool
    enable_health_checks: bool
    enable_telemetry: bool
    log_level: str
    auth_token: str = attrs.field(repr=False)
    max_session_bytes: int
    max_session_handles: int
    max_frame_bytes: int
    auth_token_file: str
    tls_cert: str
    tls_key: str
    tls_ca: str
    tls_require_client_cert: bool
    max_op_elements: int
    max_session_inflight: int
    session_idle_timeout: float
    reconnect_window: float
    handshake_timeout: float
    max_preauth_per_source: int
    max_preauth: int
    max_sessions: int
    insecure: bool
    cache_bytes: int
    share_cache: bool
    upload_cache: str
    compression: str
    compression_below_mbit: float
    compression_min_bytes: int
    isolation: str
    cuda_mps: bool
    op_deadline: float
    compile_replays: str
    profile_sessions: str
    worker_memory_overhead: int
    worker_cpu_weight: int
    sources: Mapping[str, str] = attrs.field(factory=dict, repr=False, eq=False)

    @classmethod
    def from_sources(
        cls, environ: Mapping[str, str] | None = None, /, **arguments: Any
    ) -> ClusterConfig:
        """Merge ``arguments`` over ``GENIE_*`` variables of ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        unknown = set(arguments) - set(_OPTIONS)
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(name, arguments[name], f"argument {name}", "one of " + ", ".join(sorted(_OPTIONS)))
        values: dict[str, Any] = {}
        raws: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, (kind, default, check, allowed) in _OPTIONS.items():
            if name in arguments and arguments[name] is not None:
                raw, source = arguments[name], f"argument {name}"
            elif env_name(name) in env:
                raw, source = env[env_name(name)], f"environment variable {env_name(name)}"
            else:
                raw, source = default, "default"
            value = _coerce(name, kind, raw, source, allowed)
            if check is not None and not check(value):
                raise ConfigError(name, raw, source, allowed)
            values[name], raws[name], sources[name] = value, raw, source
        values["node_role"] = NodeRole(values["node_role"])
        values["log_level"] = values["log_level"].upper()
        values["backend"] = BackendSpec.parse(values["backend"], source=sources["backend"])
        cls._check_relations(values, raws, sources)
        return cls(**values, sources=sources)

    @staticmethod
    def _check_relations(values: dict[str, Any], raws: dict[str, Any], sources: dict[str, str]) -> None:
        # Port 0 means "bind any free port": only the master binds master_port; everyone else dials it.
        if values["master_port"] == 0 and values["node_role"] != NodeRole.SERVER:
            raise ConfigError("master_port", raws["master_port"], sources["master_port"],
                              f"{_PORT_TEXT}; a {values['node_role'].value} needs the port the master reported")
        if values["heartbeat_timeout"] <= values["heartbeat_interval"]:
            raise ConfigError(
                "heartbeat_timeout", values["heartbeat_timeout"], sources["heartbeat_timeout"],
                f"a timeout longer than heartbeat_interval ({values['heartbeat_interval']:g} s)",
            )
        if values["health_check_timeout"] > values["health_check_interval"]:
            raise ConfigError(
                "health_check_timeout", values["health_check_timeout"], sources["health_check_timeout"],
                f"at most health_check_interval ({values['health_check_interval']:g} s)",
            )

    @property
    def log_level_number(self) -> int:
        return int(logging.getLevelName(self.log_level))

    def announced_endpoint(self, data_port: int, data_ports: Mapping[str, int],
                           primary: str) -> tuple[str, int, dict[str, int]]:
        """Where others reach this node's data plane: ``(host, data_port, data_ports)`` after ``advertise_*``.

        ``data_port``/``data_ports`` are the ports bound (``primary`` is the backend on ``data_port``).
        ``advertise_host`` replaces the bind address; ``advertise_ports`` a bare port replaces the data
        port (and the primary backend's), ``backend=port`` pairs replace those backends' ports.
        """
        mapping = _port_map_or_none(self.advertise_ports) or {}
        ports = dict(data_ports)
        port = data_port
        for name, advertised in mapping.items():
            if name in ("", primary):
                port = advertised
                if primary in ports:
                    ports[primary] = advertised
            else:
                ports[name] = advertised
        return self.advertise_host or self.bind_addr, port, ports

    def replace(self, **changes: Any) -> ClusterConfig:
        """A copy with some options changed, validated again as arguments."""
        current = {name: getattr(self, name) for name in _OPTIONS}
        current["node_role"] = self.node_role.value
        current["backend"] = self.backend.text
        current.update(changes)
        new = ClusterConfig.from_sources({}, **current)
        # Unchanged options keep their provenance, so later errors still name the real source.
        sources = {name: (new.sources[name] if name in changes else self.sources.get(name, new.sources[name]))
                   for name in _OPTIONS}
        return attrs.evolve(new, sources=sources)

    def resolve_master(self, pm: PluginManager) -> ClusterConfig:
        """This configuration with a ``scheme://`` master address (``ray://...``) replaced by the
        master it names, through the ``genie_resolve_master`` hook; itself for a plain host."""
        if "://" not in self.master_addr:
            return self
        scheme = self.master_addr.split("://", 1)[0]
        found = pm.resolve_master(address=self.master_addr, timeout=self.connect_timeout)
        if found is None:
            raise ConfigError("master_addr", self.master_addr, self.sources.get("master_addr", "argument master_addr"),
                              f"a host name or IP address; no installed plugin resolves {scheme}:// addresses "
                              f"(install the plugin for them, e.g. genie-{scheme})")
        host, port = found
        return self.replace(master_addr=host, master_port=port)


def option_names() -> tuple[str, ...]:
    """Every option ClusterConfig knows, in declaration order."""
    return tuple(_OPTIONS)
