"""The process's DPDK: one EAL, ports per channel, the shim's reliable streams and its polling thread.

DPDK allows one EAL per process and it cannot be started again after cleanup, so
:func:`ensure_eal` starts it once (``--no-huge --no-pci --no-shconf``, a unique
``--file-prefix``) and it lives as long as the process. The polling thread is
different: it runs only while at least one :class:`Stream` is open (reference
counted here) and is joined when the last one closes, so an idle genie process
polls nothing.

The shim (``shim.c``, compiled at install) does every burst; this module owns
lifetimes: a stream is freed only after every thread inside one of its calls has
left it (closing wakes them with an error first).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from errno import EAGAIN
from typing import Any

from genie.errors import BackendUnavailableError, ConnectionClosedError

log = logging.getLogger("genie.transport.dpdk")

NO_SHIM = ("DPDK headers/libs not found when genie-dpdk was installed, so its data path (a C shim) was not "
           "built: apt install libdpdk-dev pkg-config, then reinstall genie-dpdk")
#: DPDK's memory for the data path (MiB, --no-huge; reserved, touched as pools fill); each channel's port takes ~43 MiB.
MEMORY_MB = int(os.environ.get("GENIE_DPDK_MEMORY_MB", "512"))
MBUFS_PER_PORT = 4095  # with 2047 a transfer stalled now and then under load (cause not pinned down)
#: The engine's statistics, in the order gd_chan_stats writes them.
STAT_NAMES = ("tx_frames", "retransmits", "rx_frames", "injected_drops", "duplicates", "srtt_us")

#: How often a waiting send or receive looks at its deadline and the peer (s).
SLICE = 0.1

_lock = threading.Lock()
_eal_error: str | None = None
_eal_started = False
_streams = 0
#: Bytes this process moved over DPDK streams (sent, received): what tests and the benchmark check.
_moved = [0, 0]


def bytes_moved() -> tuple[int, int]:
    """(sent, received) bytes over every DPDK stream of this process so far."""
    return _moved[0], _moved[1]


def faults_recovered() -> int:
    """Bursts that faulted because a killed peer's shared memory went away under them (shim.c's fault
    guard): each ended its channel instead of the process."""
    return int(load_shim()[1].gd_faults_recovered()) if shim_built() else 0


def load_shim() -> tuple[Any, Any]:
    """The compiled shim's (ffi, lib); BackendUnavailableError naming the fix when it was not built."""
    try:
        from genie_dpdk._shim import ffi, lib  # type: ignore[import-not-found]
    except ImportError as exc:
        raise BackendUnavailableError(f"{NO_SHIM} ({exc})") from exc
    return ffi, lib


def shim_built() -> bool:
    """Whether the shim module exists (without loading DPDK)."""
    import importlib.util

    return importlib.util.find_spec("genie_dpdk._shim") is not None


def eal_args() -> list[str]:
    """The data path's EAL arguments (this process: the first CPU it may use, a unique file prefix)."""
    try:
        cpu = min(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError):
        cpu = 0
    return ["genie-dpdk", "--no-huge", "-m", str(MEMORY_MB), "--no-pci", "--no-shconf", "--no-telemetry",
            "-l", str(cpu), "--file-prefix", f"genie-dpdk-{os.getpid()}", "--log-level=warning"]


def _tidy_runtime_dirs(own: str) -> None:
    """Remove EAL runtime directories of data-path EALs whose process is gone; ours goes at exit.

    EAL makes ``<runtime dir>/genie-dpdk-<pid>`` even with ``--no-shconf``; a process that
    exits leaves it behind.
    """
    import atexit
    import shutil

    from genie_dpdk.eal import _pid_alive, _runtime_base

    base = _runtime_base()
    try:
        entries = list(base.iterdir())
    except OSError:
        entries = []
    for entry in entries:
        parts = entry.name.split("-")
        if entry.name.startswith("genie-dpdk-") and len(parts) == 3 and parts[2].isdigit() \
                and not _pid_alive(int(parts[2])):
            shutil.rmtree(entry, ignore_errors=True)
    atexit.register(shutil.rmtree, base / own, True)


def ensure_eal() -> tuple[Any, Any]:
    """Start this process's EAL if it is not running; (ffi, lib). BackendUnavailableError with DPDK's reason."""
    global _eal_started, _eal_error
    ffi, lib = load_shim()
    with _lock:
        if _eal_started:
            return ffi, lib
        if _eal_error is not None:
            raise BackendUnavailableError(_eal_error)
        args = eal_args()
        _tidy_runtime_dirs(f"genie-dpdk-{os.getpid()}")
        keep = [ffi.new("char[]", a.encode()) for a in args]
        rc = lib.gd_eal_init(len(keep), ffi.new("char *[]", keep))
        if rc < 0:
            _eal_error = (f"rte_eal_init failed for genie-dpdk's data path: "
                          f"{ffi.string(lib.gd_strerror(rc)).decode(errors='replace')} (rte_errno {-rc}; "
                          f"arguments {' '.join(args[1:])})")
            raise BackendUnavailableError(_eal_error)
        _eal_started = True
        log.info("DPDK EAL started for the data path (%s)", " ".join(args[1:]))
    return ffi, lib


def _nothing() -> None:
    """The default liveness check: none."""


class Port:
    """One DPDK port (a vdev: ``net_memif...`` or ``net_af_packet...``), configured and started."""

    def __init__(self, driver: str, args: str, mtu: int) -> None:
        self.ffi, self.lib = ensure_eal()
        self.name = f"{driver}_{uuid.uuid4().hex[:10]}"
        rc = self.lib.gd_port_open(self.name.encode(), args.encode(), mtu, MBUFS_PER_PORT)
        if rc < 0:
            why = self.ffi.string(self.lib.gd_strerror(rc)).decode(errors="replace")
            raise BackendUnavailableError(f"DPDK could not open {driver} ({args}): {why} (errno {-rc})")
        self.id = rc
        self.mtu = mtu
        self._closed = False

    @property
    def mac(self) -> bytes:
        out = self.ffi.new("uint8_t[6]")
        self.lib.gd_port_mac(self.id, out)
        return bytes(out)

    def link_up(self) -> bool:
        return bool(self.lib.gd_port_link_up(self.id))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.lib.gd_port_close(self.id, self.name.encode())


class Stream:
    """A reliable byte stream over ``port`` to one peer (the shim's channel); the engine runs while any is open."""

    def __init__(self, port: Port, chan_id: int, server_side: bool, peer_mac: bytes, mss: int,
                 ctl_fd: int = -1, on_freed: Callable[[], None] = _nothing) -> None:
        """``ctl_fd``: a descriptor of the channel's TCP control stream the engine watches for the peer's
        shutdown (it must stay open until ``on_freed`` runs; see shim.c's top comment); ``on_freed`` runs
        once the engine no longer sees the stream (where the channel shuts its side and closes its port)."""
        global _streams
        self.port = port
        self._on_freed = on_freed
        self.ffi, self.lib = port.ffi, port.lib
        self._users = 0
        self._cond = threading.Condition()
        self._closed = False
        self._freed = False
        self._final: dict[str, int] = {}
        handle = self.lib.gd_chan_new(port.id, chan_id, int(server_side), peer_mac, mss, ctl_fd)
        if handle == self.ffi.NULL:
            raise BackendUnavailableError("the DPDK shim has no room for another channel (64 per process)")
        self._handle = handle
        with _lock:
            _streams += 1
            rc = self.lib.gd_engine_start()
        if rc < 0:
            self.close()
            raise BackendUnavailableError(f"cannot start the DPDK polling thread (errno {-rc})")

    def set_loss(self, probability: float, seed: int) -> None:
        """Drop received frames with ``probability`` (seeded), before the protocol sees them: tests only."""
        self.lib.gd_chan_set_loss(self._handle, int(probability * 1_000_000), seed)

    def send(self, view: memoryview, timeout: float | None, alive: Callable[[], None] = _nothing) -> None:
        """Every byte of ``view``, acknowledged by the peer; ConnectionClosedError on timeout or close.

        ``alive`` runs every :data:`SLICE` s while waiting and raises when the peer is known gone
        (the channel checks its TCP stream), so a dead peer is noticed long before the timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._use() as handle:
            buf = self.ffi.from_buffer(view)
            if self.lib.gd_send_post(handle, buf, view.nbytes) < 0:
                raise ConnectionClosedError("the DPDK stream is closed")
            try:
                while True:
                    rc = self.lib.gd_send_wait(handle, SLICE)
                    if rc == 0:
                        _moved[0] += view.nbytes
                        return
                    if rc != -EAGAIN:
                        raise ConnectionClosedError("the DPDK stream closed during a send")
                    if deadline is not None and time.monotonic() > deadline:
                        raise ConnectionClosedError(f"DPDK send timed out after {timeout:g} s (the peer stopped "
                                                    "acknowledging)")
                    alive()
            except BaseException:
                self.lib.gd_fail(handle)  # the engine lets go of ``buf`` before it is released
                raise

    def recv_into(self, view: memoryview, timeout: float | None, alive: Callable[[], None] = _nothing) -> None:
        """Exactly ``view.nbytes`` bytes of the stream into ``view`` (``alive`` as for :meth:`send`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._use() as handle:
            buf = self.ffi.from_buffer(view, require_writable=True)
            got, want = 0, view.nbytes
            while got < want:
                n = self.lib.gd_recv(handle, buf + got, want - got, SLICE)
                if n < 0:
                    raise ConnectionClosedError("the DPDK stream closed during a receive")
                if n:
                    got += n
                    _moved[1] += n
                    if deadline is not None:
                        deadline = time.monotonic() + timeout  # type: ignore[operator]  # progress restarts it
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    self.lib.gd_fail(handle)
                    raise ConnectionClosedError(f"DPDK receive timed out after {timeout:g} s (no bytes arrived)")
                alive()

    def stats(self) -> dict[str, int]:
        """Frames sent, retransmitted, received, dropped by injection, duplicates; smoothed RTT (µs).

        After close: the counters as they were when the stream was freed."""
        with self._cond:
            if self._freed or self._closed:
                return dict(self._final)
            out = self.ffi.new("uint64_t[8]")
            self.lib.gd_chan_stats(self._handle, out)
        return dict(zip(STAT_NAMES, (int(v) for v in out), strict=False))

    def close(self) -> None:
        """Wake every waiter (they raise ConnectionClosedError); the channel is freed (and ``on_freed``
        runs) when the last thread inside a call has left (at once when none is), the polling thread
        stops with the last stream of the process. Safe from a thread inside a call."""
        with self._cond:
            if self._closed:
                return
            out = self.ffi.new("uint64_t[8]")
            self.lib.gd_chan_stats(self._handle, out)
            self._final = dict(zip(STAT_NAMES, (int(v) for v in out), strict=False))
            self._closed = True
            self.lib.gd_chan_close(self._handle)
            if self._users:
                return  # the last one out frees (see _InUse)
        self._free()

    def _free(self) -> None:
        global _streams
        with self._cond:
            if self._freed:
                return
            self._freed = True
        self.lib.gd_chan_free(self._handle)
        with _lock:
            _streams -= 1
            if _streams == 0:
                self.lib.gd_engine_stop()
        self._on_freed()

    def peer_gone(self) -> bool:
        """Whether the engine saw the peer shut its control stream (it no longer polls this stream then)."""
        with self._cond:
            if self._freed:
                return True
            return bool(self.lib.gd_chan_peer_gone(self._handle))

    def _use(self) -> _InUse:
        return _InUse(self)


class _InUse:
    """Counts a thread inside a shim call, so close() frees nothing under it."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        with self.stream._cond:
            if self.stream._closed:
                raise ConnectionClosedError("the DPDK stream is closed")
            self.stream._users += 1
        return self.stream._handle

    def __exit__(self, *exc: object) -> None:
        with self.stream._cond:
            self.stream._users -= 1
            last = self.stream._closed and self.stream._users == 0
        if last:
            self.stream._free()


def engine_running() -> bool:
    """Whether the polling thread runs now (False when the shim is not built)."""
    try:
        _, lib = load_shim()
    except BackendUnavailableError:
        return False
    return bool(lib.gd_engine_running())
