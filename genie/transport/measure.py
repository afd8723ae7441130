"""Measured figures: bandwidth and latency a backend really reaches, measured within a bound and cached.

A probe that can reach its peer calls :func:`measured_figures` with a way to open a
connected channel pair to it; genie then measures

- ``latency``: the median round trip of a 64-byte message (µs), and
- ``bandwidth``: ``nbytes`` up and back down again, both directions counted (Gbit/s),

through the backend's real channels (after :func:`~genie.transport.base.handshake_complete`,
so a backend measures the path it uses for data). The whole measurement is bounded by
``budget`` seconds; one that cannot finish in time gives no figures (never a guess).

Figures are cached per backend and host pair (this host's boot and name, the peer)
for ``GENIE_FIGURES_TTL`` seconds (default 3600; 0 disables the cache), in memory and
in ``figures.json`` beside the host-capability cache, so discovery pays for a
measurement once an hour, not at every ``genie.init``.

Same-host backends (shm) reach their peer's host by definition, so they measure a
loopback pair on this host: exactly the path two local processes use. Every backend a
remote node serves is measured through a real session to the node's data port for that
backend, whose server answers ECHO frames (:mod:`genie.cluster.linkfigures`, used by
``genie discover --master``): :func:`measure_with` takes any echo.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from genie.transport.base import Buffer, Channel, handshake_complete
from genie.transport.cache import cache_enabled, default_cache_dir
from genie.transport.features import allow_upgrade
from genie.types import Figure

log = logging.getLogger("genie.transport.measure")

Opener = Callable[[], tuple[Channel, Channel, Callable[[], None]]]
#: Sends its first argument and receives the same bytes back into the second.
Echo = Callable[[Buffer, memoryview], None]
EchoOpener = Callable[[], AbstractContextManager[Echo]]

_lock = threading.Lock()
_memory: dict[str, dict[str, Any]] = {}


def figures_ttl(environ: dict[str, str] | None = None) -> float:
    """``GENIE_FIGURES_TTL`` in seconds (default 3600); a malformed value is a ConfigError naming it."""
    from genie.errors import ConfigError

    text = (os.environ if environ is None else environ).get("GENIE_FIGURES_TTL", "3600")
    try:
        ttl = float(text)
    except ValueError:
        raise ConfigError("GENIE_FIGURES_TTL", text, "environment", "seconds (a number >= 0)") from None
    if ttl < 0:
        raise ConfigError("GENIE_FIGURES_TTL", text, "environment", "seconds (a number >= 0)")
    return ttl


def host_pair_key(backend: str, peer: str) -> str:
    """The cache key: backend, this host (name and boot id: a reboot or another machine is another key), peer."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{backend}|{socket.gethostname()}|{boot}|{peer}"


def _cache_file() -> Path:
    return default_cache_dir() / "figures.json"


def _load_disk() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cached(key: str, ttl: float) -> dict[str, Figure] | None:
    entry = _memory.get(key)
    if entry is None and cache_enabled():
        entry = _load_disk().get(key)
    if not isinstance(entry, dict) or time.time() - float(entry.get("at", 0)) > ttl:
        return None
    try:
        return {name: Figure(float(v), str(u), True) for name, (v, u) in entry["figures"].items()}
    except (KeyError, TypeError, ValueError):
        return None


def _store(key: str, figures: dict[str, Figure]) -> None:
    entry = {"at": time.time(), "figures": {name: [f.value, f.unit] for name, f in figures.items()}}
    _memory[key] = entry
    if not cache_enabled():
        return
    path = _cache_file()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_disk()
        data[key] = entry
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)


def measured_figures(backend: str, peer: str, opener: Opener, *, budget: float, nbytes: int = 8 << 20,
                     rtts: int = 200) -> tuple[dict[str, Figure], bool]:
    """(figures, came from the cache) for ``backend`` to ``peer``; empty figures when the budget ran out.

    ``opener`` returns a connected (client, server, cleanup) whose server end answers nothing
    by itself: this function runs the echo on a thread of its own.
    """
    return measure_with(backend, peer, lambda: local_echo(opener, budget), budget=budget, nbytes=nbytes, rtts=rtts)


def measure_with(backend: str, peer: str, open_echo: EchoOpener, *, budget: float, nbytes: int = 8 << 20,
                 rtts: int = 200, refresh: bool = False,
                 on_error: Callable[[Exception], None] | None = None) -> tuple[dict[str, Figure], bool]:
    """Like :func:`measured_figures`, through any echo: ``open_echo()`` is a context manager giving an :data:`Echo`.

    A remote peer's echo is a real session to its data port (``genie.cluster.linkfigures``).
    ``refresh`` measures even when fresh figures are cached; ``on_error`` gets the exception
    of a measurement that failed (it is logged at INFO either way).
    """
    ttl = figures_ttl()
    key = host_pair_key(backend, peer)
    with _lock:
        if ttl > 0 and not refresh:
            cached = _cached(key, ttl)
            if cached is not None:
                return cached, True
        try:
            figures = _measure(open_echo, budget, nbytes, rtts)
        except Exception as exc:  # a measurement that fails says nothing about the backend's availability
            log.info("measuring %s to %s failed: %s: %s", backend, peer, type(exc).__name__, exc)
            if on_error is not None:
                on_error(exc)
            return {}, False
        if figures and ttl > 0:
            _store(key, figures)
        return figures, False


def cached_figures(backend: str, peer: str) -> dict[str, Figure]:
    """Figures measured earlier for ``backend`` to ``peer`` and still fresh (empty when none); never measures."""
    ttl = figures_ttl()
    if ttl <= 0:
        return {}
    with _lock:
        return _cached(host_pair_key(backend, peer), ttl) or {}


@contextlib.contextmanager
def local_echo(opener: Opener, budget: float) -> Iterator[Echo]:
    """An echo over a connected pair from ``opener``, its server end answered by a thread here."""
    client, server, cleanup = opener()
    stop = threading.Event()
    thread = None
    try:
        for channel in (client, server):
            channel.settimeout(max(0.05, budget))

        def serve() -> None:
            # Requests: 8-byte size, then that many bytes; the same bytes go back.
            head = bytearray(8)
            buf = bytearray()
            with contextlib.suppress(Exception):
                while not stop.is_set():
                    server.recv_into(memoryview(head))
                    size = int.from_bytes(head, "little")
                    if size == 0:
                        return
                    if len(buf) < size:
                        buf = bytearray(size)
                    view = memoryview(buf)[:size]
                    server.recv_into(view)
                    server.sendv([view])

        thread = threading.Thread(target=serve, name="genie-measure-echo", daemon=True)
        thread.start()
        allow_upgrade(server)  # both ends are ours: the server side may take the upgrade at once
        handshake_complete(client, {})

        def echo(data: Buffer, out: memoryview) -> None:
            client.sendv([memoryview(data).nbytes.to_bytes(8, "little"), data])
            client.recv_into(out)

        yield echo
        client.sendv([(0).to_bytes(8, "little")])
    finally:
        stop.set()
        if thread is not None:
            thread.join(1.0)
        client.close()
        server.close()
        cleanup()


def _measure(open_echo: EchoOpener, budget: float, nbytes: int, rtts: int) -> dict[str, Figure]:
    deadline = time.monotonic() + budget
    with open_echo() as echo:
        small, back = os.urandom(64), bytearray(64)
        samples = []
        for _ in range(rtts):
            if time.monotonic() > deadline:
                return {}
            start = time.perf_counter()
            echo(small, memoryview(back))
            samples.append(time.perf_counter() - start)
        if back != small:
            return {}
        data, out = os.urandom(nbytes), bytearray(nbytes)
        best = float("inf")
        for _ in range(3):
            if time.monotonic() > deadline:
                break
            start = time.perf_counter()
            echo(data, memoryview(out))
            best = min(best, time.perf_counter() - start)
        if best == float("inf") or out != data:
            return {}
        return {
            "bandwidth": Figure(round(2 * nbytes * 8 / best / 1e9, 2), "Gbit/s", True),
            "latency": Figure(round(statistics.median(samples) * 1e6 / 2, 1), "us", True),
        }


def clear_memory_cache() -> None:
    """Forget figures measured in this process (tests; the disk cache stays)."""
    with _lock:
        _memory.clear()
