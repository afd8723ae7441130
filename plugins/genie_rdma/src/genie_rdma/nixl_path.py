"""genie-rdma's data path on NIXL: tensors registered as memory regions, moved by one-sided RDMA READ.

NIXL (``nixl-cu12``, its UCX backend) carries verbs, mlx5 and EFA (RDMA; GPUDirect
RDMA when a region is CUDA memory) and, where there is no RDMA device, UCX's tcp and
shared-memory transports (what CI here runs). Install it with ``pip install --no-deps
nixl-cu12==1.5.1 numpy`` (without ``--no-deps`` it pulls another torch and GBs of CUDA).

A channel keeps a TCP stream for control (records, as in genie-shm) and one NIXL
agent. After the peers' authenticated handshake (:meth:`RdmaChannel.handshake_complete`)
the agents exchange their metadata (``UPGRADE`` / ``UPGRADE_OK`` records); from then on
a buffer of at least ``BULK_MIN`` bytes crosses as:

1. the sender registers it (a memory region; CUDA memory as ``VRAM``), and sends a
   ``BULK`` record: its size, address, memory kind, a tag, and the region's partial
   NIXL metadata;
2. the receiver loads that metadata and issues one READ from the sender's region
   straight into its destination (no bounce buffer), with the tag as notification;
3. the sender sees the notification, deregisters and returns.

NIXL checks every remote descriptor against what the peer registered, so a peer
can only ever make us read *its* memory into the buffer we are filling. The metadata
blobs are parsed by NIXL's own deserializer (never pickle). Smaller buffers cross
inline on the TCP stream, where a round trip costs less than a registration.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from genie.errors import BackendUnavailableError, ConnectionClosedError, TransportError
from genie.transport.base import (
    Buffer,
    Capabilities,
    MemoryRegion,
    flat_views,
    host_view,
    region_view,
)
from genie.transport.features import Feature
from genie.transport.record import (
    DATA,
    INLINE,
    MAX_CONTROL,
    RECORD,
    UPGRADE,
    UPGRADE_OK,
    RecordChannel,
    read_body,
    read_header,
)

if TYPE_CHECKING:
    from genie.transport.stream import TcpChannel

log = logging.getLogger("genie.transport.rdma")

BULK = DATA  # a DATA record: the buffer crosses by RDMA READ (see genie.transport.record)
BULK_BODY = struct.Struct("<QQB16sI")  # address, device id, kind (0 DRAM, 1 VRAM), tag, metadata length
#: Buffers from this size go by RDMA READ; smaller ones inline on the stream.
BULK_MIN = 256 << 10
MAX_METADATA = MAX_CONTROL
_KINDS = ("DRAM", "VRAM")
INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1 numpy (no-deps: it would pull another torch and CUDA)"


def ucx_environment() -> dict[str, str]:
    """UCX settings genie applies before NIXL loads UCX, and why.

    Without an RDMA device Debian's libefa makes UCX's ib module crash both
    processes at exit, so ``UCX_MODULES=^ib`` then (a user's own value wins).
    """
    env: dict[str, str] = {}
    if not _has_rdma_devices() and "UCX_MODULES" not in os.environ:
        env["UCX_MODULES"] = "^ib"
    return env


def _has_rdma_devices() -> bool:
    try:
        return any(Path("/sys/class/infiniband").iterdir())
    except OSError:
        return False


def shared_memory_only(tls: str) -> bool:
    """True when ``UCX_TLS`` names only intra-host transports (they need error handling mode none)."""
    names = {t.strip().lstrip("^") for t in tls.split(",") if t.strip()}
    return bool(names) and not tls.startswith("^") and names <= {"shm", "posix", "sysv", "cma", "xpmem", "knem",
                                                                   "self", "sm"}


def load_nixl() -> Any:
    """Import NIXL's API module after setting UCX's environment; BackendUnavailableError with the fix if absent."""
    for key, value in ucx_environment().items():
        os.environ.setdefault(key, value)
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        raise BackendUnavailableError(f"NIXL is not installed ({exc}): {INSTALL_HINT}") from exc
    return _api


class Agent:
    """One NIXL agent with the UCX backend, thread-safe (NIXL's strict sync mode)."""

    def __init__(self) -> None:
        api = load_nixl()
        self.name = f"genie-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # No progress thread: each side drives UCX while it waits (the READ, the notification). With one, two
        # more threads poll on the host: on 2 cores 64 MiB up+down fell from 4.8 to 1.6-2.6 GB/s.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        # NIXL logs every agent and backend at INFO; genie's own log says what matters.
        logging.getLogger("nixl").setLevel(logging.WARNING)
        try:
            self.nixl = api.nixl_agent(self.name, config)
            params = {"ucx_error_handling_mode": "none"} if shared_memory_only(os.environ.get("UCX_TLS", "")) else {}
            self.nixl.create_backend("UCX", params)
        except Exception as exc:  # NIXL raises its own exception types from C++
            raise BackendUnavailableError(f"NIXL could not start its UCX backend: {exc}") from exc

    def metadata(self) -> bytes:
        return bytes(self.nixl.get_agent_metadata())

    def load_peer(self, metadata: bytes) -> str:
        name = self.nixl.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def close(self, peer: str | None) -> None:
        if peer:
            try:
                self.nixl.remove_remote_agent(peer)
            except Exception:  # the peer may be gone already; nothing to undo then
                log.debug("removing NIXL peer %s failed", peer, exc_info=True)


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class RdmaChannel(RecordChannel):
    """A NIXL-backed channel (see the module docstring); also a :class:`~genie.transport.base.BulkChannel`."""

    _protocol = "rdma"
    features: ClassVar[frozenset[Feature]] = RecordChannel.features | {Feature.BULK, Feature.HANDSHAKE}

    def __init__(self, inner: TcpChannel, agent: Agent, *, server_side: bool) -> None:
        super().__init__(inner, server_side=server_side)
        self.agent = agent
        self._peer_agent: str | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("nixl" if self.upgraded else "stream")
        return f"<RdmaChannel peer={self.peer} {state}>"

    # -- Channel -----------------------------------------------------------------------------
    def sendv(self, buffers: Sequence[Buffer]) -> None:
        """Small buffers inline on the stream; each large one by RDMA READ from its own memory."""
        self._check_open("send to")
        views = flat_views(buffers)
        with self._send_lock:
            small: list[memoryview] = []
            for view in views:
                if view.nbytes < BULK_MIN or not self.upgraded:
                    small.append(view)
                    continue
                self._send_inline(small)
                small = []
                self._send_bulk(host_view(view), "DRAM", 0)
            self._send_inline(small)

    def close(self) -> None:
        if not self._begin_close():
            return
        self.inner.close()
        self.agent.close(self._peer_agent)

    # -- bulk path ---------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """Native bulk path; CUDA memory where NIXL's UCX has a CUDA transport (GPUDirect RDMA)."""
        return Capabilities("rdma", bulk=True, device_memory=("cpu", "cuda"), zero_copy=True)

    def register(self, buffer: Any) -> MemoryRegion:
        """Host memory, or a contiguous CUDA tensor (its storage crosses by GPUDirect RDMA where the NIC can)."""
        device = getattr(buffer, "device", None)
        if device is not None and getattr(device, "type", "cpu") == "cuda":
            if not buffer.is_contiguous():
                raise ValueError("register a contiguous tensor (call .contiguous() first)")
            nbytes = buffer.numel() * buffer.element_size()
            return MemoryRegion(memoryview(b""), f"cuda:{device.index}",
                                handle=(int(buffer.data_ptr()), nbytes, int(device.index), buffer))
        return MemoryRegion(host_view(buffer))

    def deregister(self, region: MemoryRegion) -> None:
        """Nothing cached: each transfer registers and deregisters its own memory."""

    def send_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        self._check_open("send to")
        if region.device.startswith("cuda"):
            address, size, device, _ = region.handle
            count = size - offset if nbytes is None else nbytes
            if offset < 0 or count < 0 or offset + count > size:
                raise ValueError(f"region slice [{offset}:{offset + count}] is outside the registered {size} bytes")
            self._require_upgraded("GPU memory")
            with self._send_lock:
                self._send_bulk_raw(address + offset, count, "VRAM", device)
            return
        self.sendv([region_view(region, offset, nbytes)])

    def recv_region(self, region: MemoryRegion, offset: int = 0, nbytes: int | None = None) -> None:
        if not region.device.startswith("cuda"):
            self.recv_into(region_view(region, offset, nbytes))
            return
        address, size, device, _ = region.handle
        count = size - offset if nbytes is None else nbytes
        if offset < 0 or count < 0 or offset + count > size:
            raise ValueError(f"region slice [{offset}:{offset + count}] is outside the registered {size} bytes")
        self._require_upgraded("GPU memory")
        kind, length = self._next_record()
        if kind != BULK or length != count:
            raise self._failed(f"{self.peer} sent {length} bytes as record {kind} where a {count}-byte region "
                               "transfer was expected")
        self._read_bulk(address + offset, count, "VRAM", device)

    # -- the upgrade -------------------------------------------------------------------------
    def handshake_complete(self, welcome: dict[str, Any]) -> None:
        """Client side: exchange NIXL metadata now that the server proved itself."""
        if self.server_side or self.upgraded:
            return
        self._check_open("upgrade")
        try:
            body = self._client_upgrade(self.agent.metadata())
            self._peer_agent = self.agent.load_peer(body)
        except ConnectionClosedError:
            self.close()
            raise
        except Exception as exc:  # NIXL's own exception types
            self.close()
            raise ConnectionClosedError(f"NIXL upgrade with {self.peer} failed: {exc}") from exc
        self.upgraded = True
        log.debug("channel to %s uses NIXL (peer agent %s)", self.peer, self._peer_agent)

    def _serve_upgrade(self, length: int) -> None:
        body = read_body(self.inner, length)
        try:
            self._peer_agent = self.agent.load_peer(body)
            mine = self.agent.metadata()
        except Exception as exc:  # NIXL's own exception types
            log.warning("NIXL upgrade requested by %s failed: %s", self.peer, exc)
            self._refuse_upgrade(f"cannot load the peer's NIXL metadata: {exc}")
            return
        with self._send_lock:
            self._send_control(UPGRADE_OK, mine)
            self.upgraded = True

    # -- records -----------------------------------------------------------------------------
    def _send_bulk(self, view: memoryview, kind: str, device: int) -> None:
        self._send_bulk_raw(_address(view), view.nbytes, kind, device, keep=view)

    def _send_bulk_raw(self, address: int, nbytes: int, kind: str, device: int, keep: Any = None) -> None:
        """Register, announce, wait for the peer's READ to finish (its notification), deregister."""
        nixl = self.agent.nixl
        tag = uuid.uuid4().bytes
        try:
            reg = nixl.register_memory([(address, nbytes, device, "")], kind)
        except Exception as exc:
            raise self._failed(f"cannot register {nbytes} bytes of {kind} with NIXL: {exc}") from exc
        try:
            meta = bytes(nixl.get_partial_agent_metadata(reg, False, []))
            body = BULK_BODY.pack(address, device, _KINDS.index(kind), tag, len(meta))
            self.inner.sendv([RECORD.pack(BULK, nbytes), body, meta])
            self._await_notification(tag)
        finally:
            try:
                nixl.deregister_memory(reg)
            except Exception:
                log.debug("deregistering after a failed transfer to %s", self.peer, exc_info=True)
        del keep

    def _await_notification(self, tag: bytes) -> None:
        assert self._peer_agent is not None
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        pause, next_check = 0.0, time.monotonic() + 0.1
        while not self.agent.nixl.check_remote_xfer_done(self._peer_agent, tag):
            now = time.monotonic()
            if self._closed:
                raise ConnectionClosedError(f"connection to {self.peer} was closed on this side")
            if deadline is not None and now > deadline:
                raise self._failed(f"send to {self.peer} timed out after {self._timeout:g} s (RDMA READ not done)")
            if now >= next_check:  # a dead peer never reads: notice it on the stream without consuming
                next_check = now + 0.1
                self._check_peer_alive()
            # Spin briefly, then back off: polling must not starve the peer of the CPU it needs.
            pause = min(0.0005, pause + 0.00002)
            time.sleep(pause)

    def _recv_some(self, view: memoryview) -> int:
        taken = self._take_pending(view)
        if taken:
            return taken
        while not self._rec_left:
            kind, length = self._next_record()
            if kind == INLINE:
                self._rec_left = length
            elif kind == BULK:
                if view.nbytes >= length:
                    self._read_bulk(_address(view[:length]), length, "DRAM", 0)
                    return length
                landing = bytearray(length)  # the caller reads it in pieces: land it whole first
                self._read_bulk(_address(memoryview(landing)), length, "DRAM", 0)
                self._pending = landing
                return self._recv_some(view)
        return self._read_inline_part(view)

    def _next_record(self) -> tuple[int, int]:
        """The next data record's (kind, length), serving an UPGRADE on the way (server side)."""
        while True:
            kind, length = read_header(self.inner)
            if kind == UPGRADE and self.server_side and not self.upgraded and length <= MAX_METADATA:
                self._serve_upgrade(length)
                continue
            if kind == INLINE or (kind == BULK and self.upgraded):
                return kind, length
            raise self._unexpected(kind, length)

    def _read_bulk(self, address: int, nbytes: int, local_kind: str, local_device: int) -> None:
        """Read the announced region of the peer into local memory, then notify the peer with its tag."""
        body = read_body(self.inner, BULK_BODY.size)
        remote, device, kind, tag, meta_len = BULK_BODY.unpack(body)
        if kind >= len(_KINDS) or meta_len > MAX_METADATA:
            raise self._failed(f"{self.peer} sent a malformed BULK record")
        meta = read_body(self.inner, meta_len)
        nixl = self.agent.nixl
        try:
            self.agent.load_peer(meta)
            reg = nixl.register_memory([(address, nbytes, local_device, "")], local_kind)
        except Exception as exc:
            raise self._failed(f"cannot prepare the RDMA READ from {self.peer}: {exc}") from exc
        try:
            local = nixl.get_xfer_descs([(address, nbytes, local_device)], local_kind)
            far = nixl.get_xfer_descs([(remote, nbytes, device)], _KINDS[kind])
            handle = nixl.initialize_xfer("READ", local, far, self._peer_agent, tag)
            try:
                state = nixl.transfer(handle)
                deadline = None if self._timeout is None else time.monotonic() + self._timeout
                pause = 0.0
                while state == "PROC":
                    if deadline is not None and time.monotonic() > deadline:
                        raise self._failed(f"RDMA READ from {self.peer} timed out after {self._timeout:g} s")
                    pause = min(0.0005, pause + 0.00002)
                    time.sleep(pause)
                    state = nixl.check_xfer_state(handle)
            finally:
                handle.release()
            if state != "DONE":
                raise self._failed(f"RDMA READ of {nbytes} bytes from {self.peer} failed (NIXL state {state})")
        except ConnectionClosedError:
            raise
        except Exception as exc:  # NIXL refuses descriptors outside what the peer registered
            raise self._failed(f"RDMA READ from {self.peer} refused: {exc}") from exc
        finally:
            try:
                nixl.deregister_memory(reg)
            except Exception:
                log.debug("deregistering after a READ from %s", self.peer, exc_info=True)

    def _require_upgraded(self, what: str) -> None:
        if not self.upgraded:
            raise TransportError(f"{what} can cross only after the handshake (NIXL metadata not exchanged yet)")
