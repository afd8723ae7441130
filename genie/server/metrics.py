"""What a node's data-plane server counts: sessions, ops, bytes, queue depth, storage, per-session use.

The executor and server call a handful of one-line methods (marked ``# metrics:`` at
each call site); everything else lives here. Recording is plain integer and float
arithmetic under the GIL, a microsecond or less per op, because an OpenTelemetry
instrument call costs several microseconds and an op may take ten. The
OpenTelemetry instruments of :mod:`genie.telemetry.meters` read these figures
when a scrape or an export collects them.

Per-session figures (bytes held per device, ops and op time) carry who the session
belongs to: the client's node id from its HELLO (``genie.client.id``) and how it
proved itself (``genie.client.identity``: ``cluster-token`` when the node requires
the cluster token, ``anonymous`` otherwise). They exist while the session lives,
so their series come and go with clients and never pile up.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

#: Bucket limits of the op latency histogram, in seconds (10 µs to 60 s).
DURATION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Most distinct op names counted; later ones count as ``<other>`` (op names are resolved aten
#: overloads, so this is a guard, never reached in practice).
MAX_OP_NAMES = 4096


class SessionSource(Protocol):
    """What :class:`SessionMetrics` reads from a server session (genie.server.session.Session)."""

    client: dict[str, Any]  #: HELLO's node_id, role, genie and torch versions (empty before the handshake)
    serving: bool  #: True once the handshake succeeded
    store: Any  #: the session's StorageStore


class Latency:
    """A latency histogram with fixed buckets (seconds), cheap to record into."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        """Observations so far (the buckets' total: always consistent with them)."""
        return sum(self.counts)

    def record(self, seconds: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ...]`` ending with ``("+Inf", count)``, as Prometheus buckets read."""
        out, running = [], 0
        for bound, n in zip((*map(repr, DURATION_BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class Tally:
    """Counts that one thread writes: ops by (op, status), latency by status, bytes by direction and device."""

    def __init__(self) -> None:
        #: (op, status) -> count
        self.ops: dict[tuple[str, str], int] = {}
        #: status -> latency histogram
        self.latency: dict[str, Latency] = {}
        #: direction ("in": uploads, "out": fetches) -> bytes
        self.bytes: dict[str, int] = {}
        #: (device, direction) -> bytes moved between the host and that device
        self.device_io: dict[tuple[str, str], int] = {}

    def add(self, other: Tally) -> None:
        """Fold ``other`` into this tally; ``other`` may be written meanwhile by its session's thread,
        so each map is copied in one C-level step (atomic under the GIL) before it is read."""
        for key, n in list(other.ops.items()):
            self.ops[key] = self.ops.get(key, 0) + n
        for status, lat in list(other.latency.items()):
            mine = self.latency.setdefault(status, Latency())
            mine.counts = [a + b for a, b in zip(mine.counts, list(lat.counts), strict=True)]
            mine.sum += lat.sum
        for direction, n in list(other.bytes.items()):
            self.bytes[direction] = self.bytes.get(direction, 0) + n
        for key, n in list(other.device_io.items()):
            self.device_io[key] = self.device_io.get(key, 0) + n


class OkTally(NamedTuple):
    """Where a session counts its ops that ran cleanly, as the native runner (genie._C_plans)
    counts an op whose name the session counted before without a Python call, the way
    :meth:`SessionMetrics.record_op` counts it: one more in ``ops[(name, "ok")]``, one more in
    ``latency.counts`` at its bucket of ``buckets``, its seconds added to ``latency.sum``; anything else (a
    new name, an error) goes to ``record_op``. The runner binds it per session
    (genie.server.runner_api.RunnerBinding)."""

    ops: dict[tuple[str, str], int]  #: the session's tally.ops
    latency: Latency  #: the session's latency histogram of ops that ran cleanly
    buckets: tuple[float, ...]  #: DURATION_BUCKETS
    record_op: Callable[[str, str, float], None]  #: SessionMetrics.record_op


class SessionMetrics:
    """One session's figures; the executor records into it from the session's thread only, so
    plain ``+=`` is exact; readers sum sessions at collection time."""

    def __init__(self, server: ServerMetrics | None, session_id: int, source: SessionSource | None) -> None:
        self.server = server
        self.session_id = session_id
        self.source = source
        self.tally = Tally()
        self._ok = self.tally.latency["ok"] = Latency()
        #: commands of the batch being run that have not run yet
        self.queue_depth = 0

    def ok_tally(self) -> OkTally:
        """The figures the native runner counts into (see :class:`OkTally`)."""
        return OkTally(self.tally.ops, self._ok, DURATION_BUCKETS, self.record_op)

    @property
    def client_id(self) -> str:
        """The client's node id from its HELLO (``?`` before the handshake)."""
        client = self.source.client if self.source is not None else {}
        return str(client.get("node_id") or "?")[:128]

    @property
    def open(self) -> bool:
        """True while the session serves (handshake done, not ended)."""
        return self.source is not None and bool(self.source.serving)

    def record_op(self, op: str, status: str, seconds: float) -> None:
        """One op ran (``status`` ``ok`` or ``error``) in ``seconds``."""
        # The hot path of every op: few attribute lookups, no allocation but the key tuple.
        latency = self._ok if status == "ok" else self.tally.latency.setdefault(status, Latency())
        latency.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        latency.sum += seconds
        ops = self.tally.ops
        key = (op, status)
        count = ops.get(key)
        if count is None:
            if len(ops) >= MAX_OP_NAMES:
                key = ("<other>", status)
            count = ops.get(key, 0)
        ops[key] = count + 1

    @property
    def ops(self) -> int:
        """Ops this session ran."""
        return sum(list(self.tally.ops.values()))

    @property
    def errors(self) -> int:
        """Ops of this session that failed."""
        return sum(n for (_, status), n in list(self.tally.ops.items()) if status != "ok")

    @property
    def op_seconds(self) -> float:
        """Time this session's ops took."""
        return sum(lat.sum for lat in list(self.tally.latency.values()))

    def record_bytes(self, direction: str, nbytes: int, device: Any = None) -> None:
        """Tensor bytes received (``in``: uploads) or sent (``out``: fetches) by this session."""
        tally = self.tally
        tally.bytes[direction] = tally.bytes.get(direction, 0) + nbytes
        if device is not None:
            key = (str(device), direction)
            tally.device_io[key] = tally.device_io.get(key, 0) + nbytes

    def memory_by_device(self) -> dict[str, int]:
        """Bytes this session's live tensors hold, per device (``cuda:0``, ``cpu``), each storage once.

        On a node whose devices are one torch device (one GPU, or CPU devices) that is the store's
        own count, O(1); otherwise every live storage is visited (O(storages), at scrape time only).
        """
        store = self.source.store if self.source is not None else None
        devices = self.server.devices if self.server is not None else ()
        if len(set(devices)) == 1:
            return {devices[0]: int(getattr(store, "bytes_used", 0))}
        return store.bytes_by_device() if store is not None else {}

    def summary(self) -> dict[str, Any]:
        """A plain map for heartbeats and the dashboard."""
        return {"session": self.session_id, "client": self.client_id,
                "identity": self.server.identity if self.server is not None else "",
                "memory": self.memory_by_device(), "ops": self.ops, "errors": self.errors,
                "op_seconds": round(self.op_seconds, 6), "bytes_in": self.tally.bytes.get("in", 0),
                "bytes_out": self.tally.bytes.get("out", 0)}


class _NullSessionMetrics(SessionMetrics):
    """Records nothing: the executor's metrics when the node's telemetry is off."""

    def record_op(self, op: str, status: str, seconds: float) -> None:
        return

    def record_bytes(self, direction: str, nbytes: int, device: Any = None) -> None:
        return


#: What an executor records into when nobody counts (its default, and every session's with telemetry off).
NULL_SESSION_METRICS: SessionMetrics = _NullSessionMetrics(None, 0, None)


class ServerMetrics:
    """Node-wide figures of one data-plane server, and its live sessions' :class:`SessionMetrics`.

    :param backend: the data-plane backend (``genie.backend`` of the byte counters).
    :param authenticated: whether clients must prove the cluster token (``genie.client.identity``).
    :param enabled: False records nothing (every session gets :data:`NULL_SESSION_METRICS`).
    :param devices: the node's devices (``torch.device`` or names), for per-device memory.
    """

    def __init__(self, *, backend: str = "tcp", authenticated: bool = False, enabled: bool = True,
                 devices: Sequence[Any] = ()) -> None:
        self.backend = backend
        #: the node's devices as torch names (``cuda:0``, ``cpu``), by local index
        self.devices = tuple(str(d) for d in devices)
        self.identity = "cluster-token" if authenticated else "anonymous"
        self.enabled = enabled
        self._lock = threading.Lock()
        self._sessions: dict[int, SessionMetrics] = {}
        self.sessions_opened = 0
        #: what ended sessions counted (live sessions are added at collection time)
        self._retired = Tally()
        #: the node's weight cache (anything with ``stats() -> dict``), set by the server; None: no cache
        self.cache: Any = None
        #: brings live sessions' figures up to date before they are read (session workers report on request)
        self.refresh: Callable[[], None] = lambda: None

    # -- sessions (the server's accept and end paths) ---------------------------------------
    def open_session(self, session_id: int, source: SessionSource) -> SessionMetrics:
        """The metrics a new session's executor records into."""
        if not self.enabled:
            return NULL_SESSION_METRICS
        metrics = SessionMetrics(self, session_id, source)
        with self._lock:
            self._sessions[session_id] = metrics
            self.sessions_opened += 1
        return metrics

    def end_session(self, session_id: int) -> None:
        """Forget an ended session (its per-session series disappear)."""
        with self._lock:
            ended = self._sessions.pop(session_id, None)
            if ended is not None:
                self._retired.add(ended.tally)

    def sessions(self) -> list[SessionMetrics]:
        """Live sessions that finished their handshake."""
        self.refresh()
        with self._lock:
            return [s for s in self._sessions.values() if s.open]

    # -- reading (collection time) ----------------------------------------------------------
    def totals(self) -> Tally:
        """Everything counted so far: ended sessions plus live ones (monotonic)."""
        total = Tally()
        self.refresh()
        with self._lock:
            total.add(self._retired)
            live = list(self._sessions.values())
            for s in live:
                total.add(s.tally)
        return total

    def queue_depth(self) -> int:
        """Commands received in batches and not yet run, over every live session."""
        return sum(s.queue_depth for s in self.sessions())

    def storage_bytes(self) -> int:
        """Bytes held by every live session's tensors."""
        total = 0
        for s in self.sessions():
            total += int(getattr(s.source.store, "bytes_used", 0)) if s.source is not None else 0
        return total

    def summary(self) -> dict[str, Any]:
        """Per-session use for heartbeats (the master's QUERY reply, ``genie status``, the dashboard)."""
        totals = self.totals()
        return {"sessions": [s.summary() for s in self.sessions()], "sessions_opened": self.sessions_opened,
                "ops": sum(totals.ops.values()), "bytes_in": totals.bytes.get("in", 0),
                "bytes_out": totals.bytes.get("out", 0), "storage_bytes": self.storage_bytes(),
                "cache": self.cache_stats()}

    def cache_stats(self) -> dict[str, int]:
        """The weight cache's counters (genie.server.content.ContentCache.stats); empty without a cache."""
        return dict(self.cache.stats()) if self.cache is not None else {}
