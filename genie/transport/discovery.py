"""Network discovery: probe every installed transport at once, within a deadline.

:func:`discover` runs each transport's ``probe`` concurrently and returns one
:class:`~genie.types.ProbeResult` per installed transport, always within the
deadline: a probe that hangs becomes ``reason_code="timeout"``, one that raises
or breaks the contract becomes ``reason_code="error"``. Each probe runs on its own
worker thread with its own event loop, so even a probe that blocks in native code
(a verbs provider, a library constructor) cannot hold up the others or the
caller's event loop; such a thread is abandoned at the deadline and finishes on
its own.

Results of transports whose answer depends only on this host
(``Transport.host_fingerprint()`` is not None) come from the
:mod:`host-capability cache <genie.transport.cache>` when their key still matches,
so a warm discovery costs a few ``stat`` calls. Peer-dependent probes (TCP's round
trip to the master) always run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import attrs

from genie.transport.base import ProbeTarget, Transport
from genie.transport.cache import CapabilityCache, cache_enabled, cache_key, common_fingerprint, get_capability_cache
from genie.types import ProbeResult

if TYPE_CHECKING:
    from genie.plugins import PluginManager

log = logging.getLogger("genie.transport.discovery")


@attrs.frozen
class Discovery:
    """What one discovery found.

    ``results`` holds one result per installed transport, by name, in name order;
    ``cached`` names the results served from the host-capability cache;
    ``elapsed`` is the wall time of the whole discovery in seconds.
    """

    results: Mapping[str, ProbeResult]
    cached: frozenset[str]
    elapsed: float
    target: ProbeTarget

    @property
    def available(self) -> list[ProbeResult]:
        """The available results, in name order (rank them with :mod:`genie.transport.selection`)."""
        return [r for r in self.results.values() if r.available]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": {"host": self.target.host, "port": self.target.port, "timeout": self.target.timeout},
            "elapsed_ms": round(self.elapsed * 1000, 3),
            "cached": sorted(self.cached),
            "results": {name: r.to_dict() for name, r in self.results.items()},
        }


def _timeout_result(name: str, priority: int, deadline: float) -> ProbeResult:
    return ProbeResult(
        name, False, "timeout",
        f"probe did not answer within {deadline:g} s (probe_timeout); the backend is treated as unavailable",
        priority=priority,
    )


def _error_result(name: str, priority: int, what: str) -> ProbeResult:
    return ProbeResult(name, False, "error", what, priority=priority)


def _run_probe_blocking(cls: type[Transport], target: ProbeTarget) -> ProbeResult:
    """Run one probe on a fresh event loop, in the calling (worker) thread."""

    async def body() -> ProbeResult:
        # Bounded here too, so a probe awaiting forever ends its thread soon after the deadline.
        with anyio.fail_after(target.timeout + 1.0):
            return await cls().probe(target)

    return anyio.run(body)


def _checked(cls: type[Transport], result: object) -> ProbeResult:
    name = cls.name
    priority = int(getattr(cls, "default_priority", 0))
    if not isinstance(result, ProbeResult):
        return _error_result(name, priority, f"probe of {cls.__module__}.{cls.__qualname__} returned "
                             f"{type(result).__name__}, not ProbeResult (a plugin bug; report it to its authors)")
    if result.name != name:
        return _error_result(name, priority, f"probe of transport {name!r} returned a result named "
                             f"{result.name!r} (a plugin bug; report it to its authors)")
    if result.priority == 0 and priority:
        result = attrs.evolve(result, priority=priority)
    return result


class _ProbeThread(threading.Thread):
    """Runs one probe on its own event loop; a daemon, so a hung probe never blocks interpreter exit."""

    def __init__(self, cls: type[Transport], target: ProbeTarget) -> None:
        super().__init__(name=f"genie-probe-{cls.name}", daemon=True)
        self.cls = cls
        self.target = target
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = _run_probe_blocking(self.cls, self.target)
        except BaseException as exc:  # handed to the waiting task, which decides
            self.error = exc
        finally:
            self.done.set()


async def probe_one(cls: type[Transport], target: ProbeTarget, *, deadline: float | None = None) -> ProbeResult:
    """Probe one transport within ``deadline`` seconds (default ``target.timeout``); never raises."""
    deadline = target.timeout if deadline is None else deadline
    name = cls.name
    priority = int(getattr(cls, "default_priority", 0))
    started = time.perf_counter()
    thread = _ProbeThread(cls, target)
    thread.start()
    # Waiting is bounded by the deadline even if the task is never cancelled; the probe
    # thread itself is abandoned if it is still busy (see the module docstring).
    with anyio.move_on_after(deadline):
        await anyio.to_thread.run_sync(thread.done.wait, deadline, abandon_on_cancel=True)
    if not thread.done.is_set():
        log.warning("probe of transport %r did not answer within %.3g s", name, deadline)
        result = _timeout_result(name, priority, deadline)
    elif isinstance(thread.error, TimeoutError):
        result = _timeout_result(name, priority, deadline)
    elif thread.error is not None:
        exc = thread.error
        log.warning("probe of transport %r raised", name, exc_info=(type(exc), exc, exc.__traceback__))
        result = _error_result(name, priority, f"probe raised {type(exc).__name__}: {exc}")
    else:
        result = _checked(cls, thread.result)
    log.debug("probe %s: %s %s in %.1f ms", name, result.available, result.reason_code,
              (time.perf_counter() - started) * 1000)
    return result


def _fingerprint(cls: type[Transport]) -> dict[str, Any] | None:
    hook = getattr(cls, "host_fingerprint", None)
    if hook is None:
        return None
    try:
        fingerprint = hook()
    except Exception:
        log.warning("host_fingerprint of transport %r raised; probing without the cache", cls.name, exc_info=True)
        return None
    return dict(fingerprint) if fingerprint is not None else None


def plugin_versions(pm: PluginManager) -> dict[str, str]:
    """Every registered plugin's version by name (part of every cache key)."""
    return {name: f"{rec.distribution}=={rec.version}" for name, rec in pm.records.items()}


async def discover(
    pm: PluginManager,
    target: ProbeTarget | None = None,
    *,
    cache: CapabilityCache | None = None,
    use_cache: bool | None = None,
    refresh: bool = False,
) -> Discovery:
    """Probe every installed transport concurrently; return within ``target.timeout`` (plus bookkeeping).

    :param pm: the plugin manager whose ``transports()`` are probed.
    :param target: the peer to probe against (default: no peer, local capabilities only,
        2 s deadline). ``target.timeout`` is the deadline (``ClusterConfig.probe_timeout``).
    :param cache: the host-capability cache (default: the process-wide one).
    :param use_cache: False to neither read nor write the cache (default: on unless
        ``GENIE_CAPABILITY_CACHE=0``).
    :param refresh: probe every transport even when cached, then store the new results.
    """
    target = target or ProbeTarget()
    started = time.perf_counter()
    transports = pm.transports()
    if use_cache is None:
        use_cache = cache_enabled()
    if use_cache and cache is None:
        cache = get_capability_cache()
    common = common_fingerprint(plugin_versions(pm)) if use_cache else {}
    results: dict[str, ProbeResult] = {}
    cached: set[str] = set()
    keys: dict[str, str] = {}
    to_probe: list[tuple[str, type[Transport]]] = []
    for name, cls in sorted(transports.items()):
        fingerprint = _fingerprint(cls) if use_cache else None
        if fingerprint is not None and cache is not None:
            keys[name] = cache_key(cls, fingerprint, common)
            hit = None if refresh else cache.get(name, keys[name])
            if hit is not None:
                results[name] = hit
                cached.add(name)
                continue
        to_probe.append((name, cls))

    async def run(name: str, cls: type[Transport]) -> None:
        results[name] = await probe_one(cls, target)

    if to_probe:
        async with anyio.create_task_group() as tg:
            for name, cls in to_probe:
                tg.start_soon(run, name, cls)
    if cache is not None:
        for name, key in keys.items():
            if name not in cached:
                cache.put(name, key, results[name])
    elapsed = time.perf_counter() - started
    log.info("discovery: %s in %.1f ms (%d cached)",
             ", ".join(f"{n}={'yes' if r.available else r.reason_code}" for n, r in sorted(results.items())),
             elapsed * 1000, len(cached))
    return Discovery(dict(sorted(results.items())), frozenset(cached), elapsed, target)


def discover_sync(pm: PluginManager, target: ProbeTarget | None = None, **kwargs: Any) -> Discovery:
    """:func:`discover` for callers without an event loop (the CLI, benchmarks)."""

    async def body() -> Discovery:
        return await discover(pm, target, **kwargs)

    return anyio.run(body)
