"""Backend selection: rank, apply the ``backend`` option, negotiate with the peer, fall back.

The rules, in order:

1. Only available probe results are candidates, and only those whose plugin can
   carry data: a probe-only plugin marks its result ``details["data_path"] = False``
   (genie-dpdk, genie-rdma and genie-gpudev in this release).
2. Each candidate's rank is ``ProbeResult.priority`` (by default shm 500 > dpdk_gpudev
   400 > rdma 300 > dpdk 200 > tcp 100) unless a ``genie_backend_priority`` hook returns
   another int for it. Ties break by name, so the order is deterministic. Then the
   candidates whose probe *measured* a bandwidth are reordered by it, within the places
   they hold (:func:`by_measured_bandwidth`): measured beats declared only where both
   sides were measured.
3. The ``backend`` option (:class:`~genie.config.BackendSpec`, ``GENIE_BACKEND``):
   ``auto`` keeps every candidate in rank order; ``^dpdk`` drops the named ones;
   ``rdma`` keeps only that one; ``rdma,tcp`` keeps those, in the order written
   (the user's order beats the ranks). A name no installed plugin provides is a
   :class:`~genie.errors.ConfigError`.
4. With a peer, only backends both ends offer stay (the peer advertises its list,
   best first, in the handshake: :func:`advertised_backends`).
5. No candidate left is a :class:`~genie.errors.BackendUnavailableError` that lists
   every installed backend and why it was not usable. An explicit request never
   falls back to a backend the user did not name.

:func:`connect_with_fallback` then connects on the first candidate and, when that
fails, on the next, reporting each fallback through ``emit`` as a
``backend_fallback`` :class:`~genie.types.ClusterEvent` and the winner as
``backend_selected``. When every attempt fails it raises ConnectError if none reached the
peer (the peer is down, explicit request or not) and, for an explicit request that some
peer or backend refused, BackendUnavailableError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from genie.errors import BackendUnavailableError, ConnectError, PluginError
from genie.types import ClusterEvent, EventType, ProbeResult

if TYPE_CHECKING:
    from genie.config import BackendSpec, ClusterConfig
    from genie.plugins import PluginManager
    from genie.transport.base import Channel, Transport

log = logging.getLogger("genie.transport.selection")


@attrs.frozen
class Candidate:
    """An available backend and its rank (after any ``genie_backend_priority`` override)."""

    name: str
    priority: int
    result: ProbeResult
    overridden: bool = False


@attrs.frozen
class Selection:
    """The backends to try, in order, and why every other installed backend is not among them.

    ``candidates[0]`` is the one genie uses unless connecting on it fails.
    ``rejected`` maps each installed backend that is not a candidate to the reason.
    """

    candidates: tuple[Candidate, ...]
    rejected: Mapping[str, str]
    spec_text: str
    explicit: bool

    @property
    def best(self) -> Candidate:
        """The first candidate (a Selection is never empty)."""
        return self.candidates[0]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.candidates]


def effective_priority(result: ProbeResult, *, pm: PluginManager, config: ClusterConfig) -> tuple[int, bool]:
    """``result.priority``, or what the ``genie_backend_priority`` hook says instead; and whether it did."""
    override = pm.backend_priority(result=result, config=config)
    if override is None:
        return result.priority, False
    if isinstance(override, bool) or not isinstance(override, int):
        raise PluginError(
            f"a genie_backend_priority implementation returned {override!r} for {result.name!r}; "
            "it must return an int or None"
        )
    return override, True


def rank(results: Mapping[str, ProbeResult] | Sequence[ProbeResult], *, pm: PluginManager,
         config: ClusterConfig) -> list[Candidate]:
    """The available results as candidates, best first (rules 1 and 2 of the module docstring)."""
    values = list(results.values()) if isinstance(results, Mapping) else list(results)
    out = []
    for result in values:
        if not result.available or not has_data_path(result):
            continue
        priority, overridden = effective_priority(result, pm=pm, config=config)
        out.append(Candidate(result.name, priority, result, overridden))
    return by_measured_bandwidth(sorted(out, key=lambda c: (-c.priority, c.name)))


def measured_bandwidth(candidate: Candidate) -> float | None:
    """The candidate's measured ``bandwidth`` figure in Gbit/s, or None (none, declared only, or overridden)."""
    figure = candidate.result.figures.get("bandwidth")
    if candidate.overridden or figure is None or not figure.measured or figure.unit != "Gbit/s":
        return None
    return float(figure.value)


def by_measured_bandwidth(ranked: list[Candidate]) -> list[Candidate]:
    """Reorder the candidates that carry a measured bandwidth by it, within the places they hold.

    A measured figure beats a priority only against another measured figure: candidates
    without one (declared figures, a hook's override) keep their places, so a measurement
    never lifts a backend above one it was not compared with.
    """
    slots = [i for i, c in enumerate(ranked) if measured_bandwidth(c) is not None]
    fastest = sorted((ranked[i] for i in slots), key=lambda c: (-(measured_bandwidth(c) or 0.0), c.name))
    out = list(ranked)
    for i, candidate in zip(slots, fastest, strict=True):
        out[i] = candidate
    return out


def has_data_path(result: ProbeResult) -> bool:
    """False when the plugin says its probe works but it cannot carry data (``details["data_path"] is False``)."""
    return result.details.get("data_path", True) is not False


def _spec_source(config: ClusterConfig) -> str:
    return config.sources.get("backend", "argument backend")


def consider(
    results: Mapping[str, ProbeResult],
    *,
    pm: PluginManager,
    config: ClusterConfig,
    peer_backends: Sequence[str] | None = None,
    peer: str = "the peer",
) -> tuple[list[Candidate], dict[str, str]]:
    """Rules 1 to 4 without raising for an empty answer: (candidates in order, reason per rejected backend).

    :raises ConfigError: the ``backend`` option names a backend no installed plugin provides.
    """
    spec: BackendSpec = config.backend
    # Known = installed (not only probed): a caller may pass a subset of the results.
    spec.check_known(set(pm.transports()) | set(results), source=_spec_source(config))
    ranked = rank(results, pm=pm, config=config)
    rejected: dict[str, str] = {
        name: f"unavailable ({r.reason_code}): {r.reason}" for name, r in results.items() if not r.available
    }
    for name, r in results.items():
        if r.available and not has_data_path(r):
            rejected[name] = "probe ok, but no data path: " + str(r.details.get("data_path_note", "not implemented"))
    if spec.include:
        by_name = {c.name: c for c in ranked}
        candidates = [by_name[n] for n in spec.include if n in by_name]
        for c in ranked:
            if c.name not in spec.include:
                rejected[c.name] = f"not requested (backend={spec.text!r})"
    else:
        candidates = []
        for c in ranked:
            if c.name in spec.exclude:
                rejected[c.name] = f"excluded (backend={spec.text!r})"
            else:
                candidates.append(c)
    if peer_backends is not None:
        offered = list(peer_backends)
        kept = []
        for c in candidates:
            if c.name in offered:
                kept.append(c)
            else:
                rejected[c.name] = f"not offered by {peer} (it offers: {', '.join(offered) or 'nothing'})"
        candidates = kept
    return candidates, dict(sorted(rejected.items()))


def select(
    results: Mapping[str, ProbeResult],
    *,
    pm: PluginManager,
    config: ClusterConfig,
    peer_backends: Sequence[str] | None = None,
    peer: str = "the peer",
) -> Selection:
    """Apply every rule of the module docstring to one discovery's ``results``.

    :param results: one probe result per installed transport (``Discovery.results``).
    :param peer_backends: the backends the peer advertised, or None before there is a peer.
    :param peer: how to name the peer in messages.
    :raises ConfigError: the ``backend`` option names a backend no installed plugin provides.
    :raises BackendUnavailableError: no candidate is left; the message lists every reason.
    """
    spec = config.backend
    candidates, rejected = consider(results, pm=pm, config=config, peer_backends=peer_backends, peer=peer)
    if not candidates:
        raise BackendUnavailableError(_no_backend_message(spec, _spec_source(config), results, rejected))
    selection = Selection(tuple(candidates), rejected, spec.text, spec.explicit)
    log.debug("backend candidates %s (backend=%s); rejected %s", selection.names, spec.text, selection.rejected)
    return selection


def _no_backend_message(spec: BackendSpec, source: str, results: Mapping[str, ProbeResult],
                        rejected: Mapping[str, str]) -> str:
    if spec.include:
        head = f"backend {spec.text!r} was requested (from {source}) but cannot be used"
        tail = "; genie does not fall back to a backend you did not name: fix the cause, or set backend=auto"
    else:
        head = f"no usable network backend (backend={spec.text!r}, from {source})"
        tail = "; install or fix a backend plugin, or relax the backend option"
    lines = [f"{name}: {rejected.get(name, 'usable')}" for name in sorted(results)]
    return head + ". Every installed backend: " + "; ".join(lines) + tail


def advertised_backends(selection: Selection) -> list[str]:
    """The backends to offer a peer in the handshake, best first (the local candidates)."""
    return selection.names


@attrs.frozen
class ConnectOutcome:
    """The channel :func:`connect_with_fallback` opened, on which backend, after which fallbacks.

    ``fallbacks`` lists ``(backend, reason)`` for every backend tried before the winner.
    """

    channel: Channel
    backend: str
    fallbacks: tuple[tuple[str, str], ...]


Address = tuple[str, int]


def connect_with_fallback(
    selection: Selection,
    transports: Mapping[str, type[Transport]],
    address: Address | Mapping[str, Address] | Callable[[str], Address],
    *,
    timeout: float,
    emit: Callable[[ClusterEvent], Any] | None = None,
    source: str = "",
) -> ConnectOutcome:
    """Connect to the peer on the best candidate, falling back in order when a connect fails.

    Blocking (transports' ``connect`` is); call it from a worker thread when on an event loop.

    :param selection: from :func:`select` (after negotiation with the peer).
    :param transports: transport classes by name (``PluginManager.transports()``).
    :param address: the peer's ``(host, port)``, one per backend name, or a function of the name.
    :param timeout: per-attempt connect timeout in seconds (``ClusterConfig.connect_timeout``).
    :param emit: called with a ``backend_fallback`` event after each failed attempt that is followed
        by another, and a ``backend_selected`` event once connected.
    :param source: the node id the events are about.
    :raises BackendUnavailableError: every candidate failed, the request was explicit, and some failure
        was not one of reaching the peer (a listener refused the backend, the backend itself broke).
    :raises ConnectError: every candidate failed under ``auto`` or exclusions; or, explicit or not, no
        candidate reached the peer at all (refused connections, timeouts): the peer is unreachable, which
        says nothing about the backend, and callers treat it as a node that is down.
    """
    fallbacks: list[tuple[str, str]] = []
    unreachable = True
    names = selection.names
    for i, name in enumerate(names):
        host, port = _address_for(address, name)
        try:
            channel = transports[name]().connect(host, port, timeout=timeout)
        except Exception as exc:
            reason = f"connect to {host}:{port} failed: {type(exc).__name__}: {exc}"
            log.warning("backend %s: %s", name, reason, exc_info=not isinstance(exc, OSError))
            fallbacks.append((name, reason))
            unreachable = unreachable and _is_unreachable(exc)
            if emit is not None and i + 1 < len(names):
                _emit(emit, ClusterEvent(EventType.BACKEND_FALLBACK, source, {
                    "from": name, "to": names[i + 1], "reason": reason, "explicit": selection.explicit,
                }))
            continue
        best = selection.candidates[i]
        if fallbacks:
            log.warning("data plane fell back to %s after: %s", name, "; ".join(f"{b}: {r}" for b, r in fallbacks))
        log.info("data plane backend %s (priority %d) to %s:%d", name, best.priority, host, port)
        if emit is not None:
            _emit(emit, ClusterEvent(EventType.BACKEND_SELECTED, source, {
                "backend": name, "priority": best.priority, "peer": f"{host}:{port}",
                "fallbacks": [list(f) for f in fallbacks], "explicit": selection.explicit,
                "spec": selection.spec_text,
            }))
        return ConnectOutcome(channel, name, tuple(fallbacks))
    detail = "; ".join(f"{b}: {r}" for b, r in fallbacks)
    others = "; ".join(f"{b}: {r}" for b, r in selection.rejected.items())
    message = f"could not connect on any backend ({detail})" + (f"; not tried: {others}" if others else "")
    if selection.explicit:
        message = f"backend {selection.spec_text!r} was requested but {message}"
        if not unreachable:
            raise BackendUnavailableError(message)
        # Nothing answered on any named backend: the peer is down or cut off, not short of the backend.
        # Still no fallback to a backend the user did not name; the caller decides what an unreachable
        # peer means (a client marks that node's devices lost, as under auto).
        raise ConnectError(message + "; the peer did not answer on any of them: is it running and reachable?")
    raise ConnectError(message)


def _is_unreachable(exc: BaseException) -> bool:
    """Whether a connect failure means the peer could not be reached (nothing there answered), as opposed to
    a listener that refused the backend (BackendUnavailableError) or a backend that failed in itself."""
    if isinstance(exc, BackendUnavailableError):
        return False
    return isinstance(exc, (ConnectError, ConnectionError, TimeoutError))


def _address_for(address: Address | Mapping[str, Address] | Callable[[str], Address], name: str) -> Address:
    if callable(address):
        return address(name)
    if isinstance(address, Mapping):
        return address[name]
    return address


def _emit(emit: Callable[[ClusterEvent], Any], event: ClusterEvent) -> None:
    try:
        emit(event)
    except Exception:
        log.warning("event callback failed for %s", event.type.value, exc_info=True)
