"""One client's data-plane session: handshake, then batches, on its own thread.

The session owns its channel, its :class:`~genie.server.store.TensorStore` and
its :class:`~genie.server.executor.Executor`. Its life:

1. The first frame must be HELLO, within ``hello_timeout``. It is checked for the
   protocol version, a torch release with the same major.minor, and the cluster
   token when one is configured. The answer is WELCOME, or REJECT
   ``{"code", "reason"}`` naming both sides' versions, after which the
   connection closes.
2. Then BATCH frames, each run to completion in order, until GOODBYE or the
   peer goes away.
3. A frame that breaks the wire rules is logged (logger ``genie.server``) with
   its reason, answered with an ERROR frame ``{"code": "frame", "reason"}`` if
   the connection still works, and the connection is closed. Other sessions
   never notice.
4. However the session ends, every tensor it held is freed.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from genie.errors import ConnectionClosedError, FrameError, GenieError, ProtocolError, QuotaExceededError
from genie.server.executor import Executor
from genie.server.store import TensorStore
from genie.transport.base import Channel
from genie.wire.frame import PROTOCOL_VERSION, MsgKind, pack_body, recv_header_and_body, send_frame, unpack_body
from genie.wire.messages import torch_compatible

log = logging.getLogger("genie.server")


class Session:
    """A client connection being served; :meth:`run` is the body of its thread."""

    def __init__(
        self,
        channel: Channel,
        *,
        session_id: int,
        welcome: Callable[[], dict[str, Any]],
        devices: list[torch.device],
        max_handles: int,
        max_bytes: int,
        max_payload: int,
        auth_token: str = "",
        hello_timeout: float = 10.0,
        on_end: Callable[[Session], None] = lambda s: None,
    ) -> None:
        self.channel = channel
        self.session_id = session_id
        self.peer = getattr(channel, "peer", "?")
        self.store = TensorStore(max_handles=max_handles, max_bytes=max_bytes)
        self.executor = Executor(channel, self.store, devices)
        self.client: dict[str, Any] = {}
        self._welcome = welcome
        self._max_payload = max_payload
        self._auth_token = auth_token
        self._hello_timeout = hello_timeout
        self._on_end = on_end
        self.thread: threading.Thread | None = None
        self.closing = False

    def __repr__(self) -> str:
        return f"<Session {self.session_id} peer={self.peer}>"

    def stats(self) -> dict[str, Any]:
        """The session's store counts and how many ops it ran."""
        return {"peer": self.peer, **self.store.stats(), "ops": self.executor.ops_run}

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
            if not self.closing:
                log.info("session %d (%s) ended: %s", self.session_id, self.peer, exc)
        except (FrameError, ProtocolError, QuotaExceededError) as exc:
            log.warning("closing session %d (%s): %s", self.session_id, self.peer, exc)
            self._send_quietly(MsgKind.ERROR, {"code": "frame", "reason": str(exc)})
        except Exception:
            log.exception("session %d (%s) failed; closing it", self.session_id, self.peer)
            self._send_quietly(MsgKind.ERROR, {"code": "internal", "reason": "internal server error; see server log"})
        finally:
            freed = self.store.clear()
            self.channel.close()
            log.info("session %d (%s) closed: freed %d handles, %d bytes",
                     self.session_id, self.peer, freed["handles"] + freed["poisoned"], freed["bytes"])
            self._on_end(self)

    # -- phases -------------------------------------------------------------------------------

    def _handshake(self) -> bool:
        self.channel.settimeout(self._hello_timeout)
        try:
            header, body = recv_header_and_body(self.channel, max_payload=0)
        except ConnectionClosedError as exc:
            # Probes connect and leave without a word: not worth a warning.
            log.debug("connection from %s closed before HELLO: %s", self.peer, exc)
            self.closing = True
            return False
        except FrameError as exc:
            log.warning("refusing %s: %s", self.peer, exc)
            self._send_quietly(MsgKind.REJECT, {"code": "frame", "reason": str(exc)})
            return False
        if header.kind != MsgKind.HELLO:
            return self._reject("frame", f"the first frame must be HELLO, got {header.kind.name}")
        hello = unpack_body(body)
        if not isinstance(hello, dict):
            return self._reject("frame", "HELLO body must be a map")
        protocol, theirs = hello.get("protocol"), hello.get("torch")
        if protocol != PROTOCOL_VERSION:
            return self._reject(
                "protocol", f"client speaks genie protocol {protocol!r}, this server speaks {PROTOCOL_VERSION}; "
                "install matching genie versions")
        if not isinstance(theirs, str) or not torch_compatible(torch.__version__, theirs):
            return self._reject(
                "torch_version", f"client runs torch {theirs!r}, this server runs torch {torch.__version__}; "
                "op schemas differ between releases, so both sides need the same major.minor")
        if self._auth_token:
            token = hello.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._auth_token.encode()):
                return self._reject("auth", "wrong or missing cluster token")
        self.client = {k: hello.get(k) for k in ("node_id", "role", "genie", "torch")}
        self.channel.settimeout(None)
        send_frame(self.channel, MsgKind.WELCOME, pack_body(self._welcome()))
        log.info("session %d opened for %s (node %r)", self.session_id, self.peer, self.client.get("node_id"))
        return True

    def _serve(self) -> None:
        while True:
            header, body = recv_header_and_body(self.channel, max_payload=self._max_payload)
            if header.kind == MsgKind.BATCH:
                self.executor.run_batch(header, body)
            elif header.kind == MsgKind.GOODBYE:
                log.debug("session %d (%s) said goodbye", self.session_id, self.peer)
                self.closing = True
                return
            else:
                raise FrameError(f"unexpected {header.kind.name} frame in a data-plane session")

    # -- helpers ------------------------------------------------------------------------------

    def _reject(self, code: str, reason: str) -> bool:
        log.warning("rejecting %s: %s", self.peer, reason)
        self._send_quietly(MsgKind.REJECT, {"code": code, "reason": reason})
        return False

    def _send_quietly(self, kind: MsgKind, body: dict[str, Any]) -> None:
        try:
            send_frame(self.channel, kind, pack_body(body))
        except GenieError:
            pass  # the peer is already gone; the log line above says why
