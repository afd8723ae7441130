"""One client's data-plane session: handshake, then batches, on its own thread.

The session owns its channel, its :class:`~genie.server.store.StorageStore` and
its :class:`~genie.server.executor.Executor`. Its life:

1. With TLS configured, the TLS handshake (:func:`genie.wire.handshake.secure_server_channel`).
   The first frame must then be HELLO (a body of at most
   :data:`~genie.wire.frame.MAX_HANDSHAKE_BODY_BYTES`); the whole handshake must end within the
   server's absolute deadline (:mod:`genie.server.preauth` closes the channel then). It is checked for the
   protocol version, then, when the cluster has a token, the client must answer an
   HMAC challenge (:func:`genie.wire.handshake.server_challenge`; the token never
   crosses the wire), then for a torch release with the same major.minor. The
   answer is WELCOME, or REJECT ``{"code", "reason"}`` naming both sides'
   versions, after which the connection closes (:func:`genie.server.preauth.authenticate`, which a
   node with session workers runs itself before it assigns one: such a session starts ``admitted``,
   at WELCOME). Only then does ``on_open`` count it as a session (it may refuse with REJECT
   ``{"code": "busy"}`` when ``max_sessions`` are open). A backend's channel upgrade (shared
   memory) is allowed only once WELCOME is sent.
2. Then BATCH frames, each run to completion in order (and ECHO frames, whose payload of at most
   :data:`~genie.wire.frame.MAX_ECHO_BYTES` goes straight back: clients measure a backend's
   path with them), until GOODBYE, the peer
   goes away, or no frame comes for ``idle_timeout`` seconds (the session is
   closed and its memory freed).
3. A frame that breaks the wire rules is logged (logger ``genie.server``) with
   its reason, answered with an ERROR frame ``{"code": "frame", "reason"}`` if
   the connection still works, and the connection is closed. Other sessions
   never notice.
4. However the session ends, every storage it held is freed.
5. A session worker's session can be resumed (:mod:`genie.wire.resume`): when its connection drops
   (reset, EOF; not the idle timeout, not GOODBYE) it waits up to ``reconnect_window`` seconds for
   the node to hand it the client's new connection (``wait_resume``), answers WELCOME with
   ``"resumed": {"batches": n}`` there, sends the last reply again if the client waits for it, and
   serves on with every storage it had; the native runner's loop returns here on EOF and is
   re-entered on the new connection. What it counts and records: :mod:`genie.server.resume`.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from genie.errors import (
    ConnectionClosedError,
    FrameError,
    GenieError,
    PluginError,
    ProtocolError,
    QuotaExceededError,
    RemoteDeviceLost,
)
from genie.server.executor import Executor
from genie.server.host import NodeDevice
from genie.server.preauth import Admitted, authenticate, reject
from genie.server.resume import ResumeLink
from genie.server.store import StorageStore
from genie.transport.base import Channel
from genie.transport.features import NativeRecords, allow_upgrade, native_records_of, native_stream, native_stream_of
from genie.wire.compress import available_codecs
from genie.wire.frame import (
    HEADER,
    MAX_ECHO_BYTES,
    FrameHeader,
    MsgKind,
    check_header,
    pack_body,
    recv_frame,
    send_frame,
)

log = logging.getLogger("genie.server")


class Session:
    """A client connection being served; :meth:`run` is the body of its thread."""

    def __init__(
        self,
        channel: Channel,
        *,
        session_id: int,
        welcome: Callable[[], dict[str, Any]],
        devices: Sequence[NodeDevice | torch.device],
        max_storages: int,
        max_bytes: int,
        max_payload: int,
        auth_token: str | bytes = "",
        hello_timeout: float = 10.0,
        tls_context: ssl.SSLContext | None = None,
        idle_timeout: float = 0.0,
        max_inflight: int = 0,
        on_end: Callable[[Session], None] = lambda s: None,
        on_open: Callable[[Session], str | None] = lambda s: None,
        admitted: Admitted | None = None,
    ) -> None:
        self.channel = channel
        self.session_id = session_id
        self.peer = channel.peer
        self.store = StorageStore(max_storages=max_storages, max_bytes=max_bytes)
        self.executor = Executor(channel, self.store, devices)
        self.client: dict[str, Any] = {}
        self._welcome = welcome
        self._max_payload = max_payload
        self._auth_token = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self._tls = tls_context
        self.idle_timeout = idle_timeout
        if max_inflight:
            self.executor.max_inflight = max_inflight
        self._hello_timeout = hello_timeout
        self._on_end = on_end
        self._on_open = on_open
        self._admitted = admitted  #: the node ran the handshake already (a session worker): WELCOME is next
        self.thread: threading.Thread | None = None
        self.closing = False
        self.serving = False
        #: why the session ended on a lost CUDA context (RemoteDeviceLost), else None: the node's, when in-process
        self.lost_context: str | None = None
        self._echo_buffer = bytearray()  # measurement sessions reuse it (genie.cluster.linkfigures)
        #: waits up to its argument (seconds) for the client's resumed connection: (channel, the node's info)
        #: or None; set by a session worker (genie.server.isolation.worker) when the session can be resumed
        self.wait_resume: Callable[[float], tuple[Channel, dict[str, Any]] | None] | None = None
        self.resume_window = 0.0
        self.resumes = 0  #: connections resumed after a drop
        self._link: ResumeLink | None = None  #: the executor's view of the channel while resumable

    def __repr__(self) -> str:
        return f"<Session {self.session_id} peer={self.peer}>"

    def stats(self) -> dict[str, Any]:
        """The session's store counts, how many ops it ran, how many of those ran by a command plan and how
        many of those by the native plan runner."""
        return {"peer": self.peer, **self.store.stats(), "ops": self.executor.ops_run,
                "planned": self.executor.plan_runs, "native": self.executor.native_runs,
                "batches": self.batches, "resumes": self.resumes}

    @property
    def batches(self) -> int:
        """BATCH frames received whole (each ran once) while the session is resumable, else 0."""
        return self._link.batches if self._link is not None else 0

    def close(self) -> None:
        """Close the connection from another thread; the session thread then ends and frees everything."""
        self.closing = True
        self.channel.close()

    def run(self) -> None:
        """Serve the connection until it ends; never raises."""
        try:
            if self._handshake():
                self._serve()
        except ConnectionClosedError as exc:
            if self.serving and isinstance(exc.__cause__, TimeoutError) and self.idle_timeout:
                log.warning("session %d (%s) idle for more than %g s (session_idle_timeout): closing it",
                            self.session_id, self.peer, self.idle_timeout)
            elif not self.closing:
                log.info("session %d (%s) ended: %s", self.session_id, self.peer, exc)
        except QuotaExceededError as exc:
            log.warning("closing session %d (%s): %s", self.session_id, self.peer, exc)
            self._send_quietly(MsgKind.ERROR, {"code": "quota", "reason": str(exc)})
        except RemoteDeviceLost as exc:  # a CUDA sticky error: with isolation none, the node's other sessions too
            log.error("closing session %d (%s): %s", self.session_id, self.peer, exc)
            self.lost_context = str(exc)
            self._send_quietly(MsgKind.ERROR, {"code": "lost", "reason": str(exc)})
        except (FrameError, ProtocolError) as exc:
            log.warning("closing session %d (%s): %s", self.session_id, self.peer, exc)
            self._send_quietly(MsgKind.ERROR, {"code": "frame", "reason": str(exc)})
        except Exception:
            log.exception("session %d (%s) failed; closing it", self.session_id, self.peer)
            self._send_quietly(MsgKind.ERROR, {"code": "internal", "reason": "internal server error; see server log"})
        finally:
            freed = self.store.clear()
            self.channel.close()
            log.info("session %d (%s) closed: freed %d storages, %d bytes%s",
                     self.session_id, self.peer, freed["storages"] + freed["poisoned"], freed["bytes"],
                     f"; {self.batches} batches received, {self.resumes} resumes" if self._link is not None else "")
            self._on_end(self)

    # -- phases -------------------------------------------------------------------------------

    def _handshake(self) -> bool:
        """TLS, HELLO and the token's challenge (unless the node ran them: ``admitted``), then WELCOME."""
        admitted = self._admitted
        if admitted is None:
            admitted = authenticate(self.channel, token=self._auth_token, tls=self._tls, timeout=self._hello_timeout)
            if admitted is None:
                self.closing = True  # refused and logged (rate-limited) already
                return False
            self.client = dict(admitted.client)
            if admitted.resume is not None:
                return self._reject("resume", "this node runs sessions in its own process (isolation none), "
                                    "which cannot be resumed; the session is gone")
            refusal = self._on_open(self)
            if refusal is not None:
                return self._reject("busy", refusal)
        self.client = dict(admitted.client)
        # codecs: what this node decompresses uploads with and compresses fetch replies with (genie.wire.compress)
        welcome = {**self._welcome(), "cache": self.executor.transfers.offer(), "codecs": list(available_codecs())}
        if admitted.auth is not None:
            welcome["auth"] = admitted.auth
        self.channel.settimeout(self.idle_timeout or None)
        send_frame(self.channel, MsgKind.WELCOME, pack_body(welcome))
        allow_upgrade(self.channel)  # a backend's UPGRADE is served only after WELCOME (genie.transport.record)
        self.serving = True
        log.info("session %d opened for %s (node %r)", self.session_id, self.peer, self.client.get("node_id"))
        return True

    def _serve(self) -> None:
        head, max_payload, run_batch = memoryview(bytearray(HEADER.size)), self._max_payload, self.executor.run_batch
        stream: tuple[int, bool] | None = None  # a duplicate of the channel's socket, while the runner serves it
        link = None
        native = self.executor.native
        # A runner built before it counted its batches (genie._C_plans without served()) cannot be resumed over.
        if self.wait_resume is not None and self.resume_window and (native is None or hasattr(native, "served")):
            link = self._link = ResumeLink(self.channel, native)
            self.executor.channel = link  # type: ignore[assignment]
        try:
            while True:
                try:
                    if stream is None and self.executor.native is not None:
                        stream = self._native_stream()
                    if stream is not None and self._channel_at_rest():
                        got = self.executor.serve_native(*stream)
                        if link is not None:
                            link.native_served()
                        if got is None:
                            continue
                        kind, body, payload_len = self._take_over(got, head, max_payload)
                    else:
                        kind, body, payload_len = recv_frame(self.channel, head, max_payload=max_payload)
                    if kind == MsgKind.BATCH:
                        if link is not None:
                            link.batch_read(payload_len)
                        run_batch(FrameHeader(kind, len(body), payload_len), body)
                        if link is not None:
                            link.batch_done()
                    elif kind == MsgKind.ECHO:
                        if link is not None:
                            link.frame_read()
                        self._echo(payload_len)
                    elif kind == MsgKind.GOODBYE:
                        log.debug("session %d (%s) said goodbye", self.session_id, self.peer)
                        self.closing = True
                        return
                    else:
                        raise FrameError(f"unexpected {kind.name} frame in a data-plane session")
                except ConnectionClosedError as exc:
                    if link is None or self.closing or isinstance(exc.__cause__, TimeoutError):
                        raise
                    link.dropped_in_batch()
                    if stream is not None:
                        os.close(stream[0])
                        stream = None
                    if not self._resume(link, exc):
                        raise
        finally:
            if stream is not None:
                os.close(stream[0])

    def _resume(self, link: ResumeLink, exc: ConnectionClosedError) -> bool:
        """The connection dropped: wait for the client's resumed one (within the window) and take it up there;
        False when none came (the session ends, its storages freed)."""
        assert self.wait_resume is not None
        window = self.resume_window
        log.info("session %d (%s): connection dropped (%s); waiting up to %g s for the client to resume",
                 self.session_id, self.peer, exc, window)
        deadline = time.monotonic() + window
        while True:
            got = self.wait_resume(max(0.0, deadline - time.monotonic()))
            if got is None:
                log.warning("session %d (%s): the client did not resume within the reconnect window of %g s; "
                            "closing it and freeing its storages", self.session_id, self.peer, window)
                self.closing = True  # nobody to tell
                return False
            channel, info = got
            old, self.channel = self.channel, channel
            link.attach(channel)
            old.close()
            record = link.record
            replay = bool(info.get("await")) and info.get("sent") == link.batches and record is not None \
                and record[0] == link.batches
            welcome = {**info.get("welcome", {}), "resumed": {"batches": link.batches, "replay": replay}}
            if info.get("auth") is not None:
                welcome["auth"] = info["auth"]
            try:
                channel.settimeout(self.idle_timeout or None)
                send_frame(channel, MsgKind.WELCOME, pack_body(welcome))
                if replay:
                    assert record is not None
                    channel.sendv([record[1]])
            except ConnectionClosedError as again:  # dropped again at once: wait for the next resume
                log.info("session %d: the resumed connection dropped too (%s)", self.session_id, again)
                continue
            self.resumes += 1
            log.info("session %d resumed at batch %d%s", self.session_id, link.batches,
                     " (its last reply sent again)" if replay else "")
            return True

    def _native_stream(self) -> tuple[int, bool] | None:
        """A duplicate of the channel's socket for the native runner to read batches from (genie._C_plans:
        a batch of commands it finishes never reaches Python), where the channel offers its stream (plain
        TCP; shared memory once upgraded) and the handshake is done."""
        got = native_stream(self.channel) if self.serving else None
        return (os.dup(got[0]), got[1]) if got is not None else None

    def _channel_at_rest(self) -> bool:
        native = native_stream_of(self.channel)  # declared: it gave _native_stream its stream
        return native is not None and native.at_rest()

    def _take_over(self, got: tuple[Any, ...], head: memoryview, max_payload: int) -> tuple[MsgKind, Any, int]:
        """A frame the native runner read but leaves to Python (Executor.serve_native): (kind, body, payload
        length), the channel then where it would be after recv_frame."""
        if got[0] == "frame":
            _, header, body, leftover = got
            if leftover:
                self._native_records().unread(leftover)
            kind, _, payload_len = check_header(header, max_payload=max_payload)
            return kind, body, payload_len
        if got[0] == "resume":
            self._native_records().resume_record(got[1], got[2], got[3])
            return recv_frame(self.channel, head, max_payload=max_payload)
        why, text = got[1], got[2]
        cause = TimeoutError(text) if why == "timeout" else OSError(text)
        raise ConnectionClosedError(f"connection to {self.peer}: {text}") from cause

    def _native_records(self) -> NativeRecords:
        """The channel's NativeRecords: declared by every channel whose native stream carries records."""
        records = native_records_of(self.channel)
        if records is None:
            raise PluginError(f"the {type(self.channel).__name__} of {self.peer} handed the native runner a stream "
                              "but does not declare Feature.NATIVE_RECORDS to take back what it read; its backend "
                              "must declare it (genie.transport.features)")
        return records

    def _echo(self, nbytes: int) -> None:
        """Send an ECHO's payload back as it came: what a client measures a backend's path to this node with."""
        if nbytes > MAX_ECHO_BYTES:
            raise FrameError(f"ECHO payload of {nbytes} bytes exceeds the {MAX_ECHO_BYTES}-byte limit of measurements")
        if len(self._echo_buffer) < nbytes:
            self._echo_buffer = bytearray(nbytes)
        view = memoryview(self._echo_buffer)[:nbytes]
        if nbytes:
            self.channel.recv_into(view)
        send_frame(self.channel, MsgKind.ECHO, pack_body({}), [view])

    # -- helpers ------------------------------------------------------------------------------

    def _reject(self, code: str, reason: str) -> bool:
        reject(self.channel, code, reason)
        return False

    def _send_quietly(self, kind: MsgKind, body: dict[str, Any]) -> None:
        try:
            send_frame(self.channel, kind, pack_body(body))
        except GenieError:
            pass  # the peer is already gone; the log line above says why
