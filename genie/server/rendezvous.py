"""The key-value store session workers form a torch.distributed group on, authenticated by a group secret.

gloo's own store (``TCPStore``) lets anyone who reaches its port read and write every key, so the
workers of a group rendezvous over this one instead: :class:`StoreServer` runs in the session
worker of rank 0, :class:`AuthStore` (a ``torch.distributed.Store``, which ``ProcessGroupGloo``
takes like any other) in every rank's worker. A connection proves, both ways, that its peer knows
the group's secret before any key moves: the server sends a nonce, the client answers with its own
nonce and ``HMAC-SHA256(secret, "genie-store-client" || ns || nc)``, the server answers with the
``"genie-store-server"`` MAC of the same nonces. The secret is derived by the nodes from the
cluster token (:func:`genie.server.node_answers.group_secret`): the worker never holds the token.

Requests and answers are msgpack arrays behind a 4-byte length, never pickles; a frame, a key,
a value and the number of keys are bounded, and a connection that breaks a rule is closed.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

import msgpack
import torch.distributed as dist

from genie.errors import AuthenticationError, ConnectError, ProtocolError

log = logging.getLogger("genie.server.collectives")

#: Largest request or answer, key or value: gloo's rendezvous stores addresses of a few dozen bytes.
MAX_FRAME = 1 << 20
MAX_KEYS = 1 << 14
#: Most connections one store serves at once (each rank's worker holds one).
MAX_CONNECTIONS = 1024
#: Seconds a connection has to finish the proof once accepted.
PROOF_TIMEOUT = 5.0
_LEN = struct.Struct("!I")


def _mac(secret: bytes, role: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(secret, b"genie-store-" + role + b"\0" + ns + nc, hashlib.sha256).digest()


def _send(sock: socket.socket, value: Any) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the store connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> Any:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"a store frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return msgpack.unpackb(_recv_exact(sock, length), raw=False, use_list=True)


class StoreServer:
    """A store on ``host`` port 0 (``.port`` once bound), served by one thread per connection until :meth:`close`."""

    def __init__(self, host: str, secret: bytes) -> None:
        self._secret = secret
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="genie-dist-store", daemon=True).start()

    def close(self) -> None:
        """Stop serving: the listener and every connection close."""
        with self._cond:
            self._closed = True
            conns, self._conns = list(self._conns), set()
            self._cond.notify_all()
        for sock in [self._listener, *conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected (the listener) or gone already
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._cond:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    sock.close()
                    continue
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="genie-dist-store-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(PROOF_TIMEOUT)
            ns = os.urandom(16)
            sock.sendall(ns)
            nc, proof = _recv_exact(sock, 16), _recv_exact(sock, 32)
            if not hmac.compare_digest(proof, _mac(self._secret, b"client", ns, nc)):
                log.warning("process-group store: a connection failed the group secret's proof; closed")
                return
            sock.sendall(_mac(self._secret, b"server", ns, nc))
            sock.settimeout(None)
            while True:
                _send(sock, self._answer(_recv(sock)))
        except (OSError, ConnectionError, ProtocolError, ValueError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError):
            pass  # the peer left or broke the protocol: its connection ends, the store goes on
        finally:
            with self._cond:
                self._conns.discard(sock)
            sock.close()

    def _answer(self, req: Any) -> Any:
        if not isinstance(req, list) or not req or not isinstance(req[0], str):
            raise ProtocolError("a store request must be [verb, ...]")
        verb, args = req[0], req[1:]
        keys = [a for a in args if isinstance(a, str)]
        if any(len(k) > 4096 for k in keys):
            raise ProtocolError("a store key is longer than 4096 characters")
        with self._cond:
            if verb == "set" and len(args) == 2 and isinstance(args[1], bytes):
                self._put(args[0], args[1])
                return ["ok"]
            if verb == "get" and len(args) == 2:
                return self._wait_for([args[0]], args[1]) or ["ok", self._data[args[0]]]
            if verb == "add" and len(args) == 2 and type(args[1]) is int:
                value = int(self._data.get(args[0], b"0") or b"0") + args[1]
                self._put(args[0], str(value).encode())
                return ["ok", value]
            if verb == "cas" and len(args) == 3 and isinstance(args[1], bytes) and isinstance(args[2], bytes):
                current = self._data.get(args[0])
                if (current is None and not args[1]) or current == args[1]:
                    self._put(args[0], args[2])
                    return ["ok", args[2]]
                return ["ok", current if current is not None else args[1]]
            if verb == "check" and len(args) == 1 and isinstance(args[0], list):
                return ["ok", all(k in self._data for k in args[0])]
            if verb == "wait" and len(args) == 2 and isinstance(args[0], list):
                return self._wait_for(args[0], args[1]) or ["ok"]
            if verb == "del" and len(args) == 1:
                return ["ok", self._data.pop(args[0], None) is not None]
            if verb == "num" and not args:
                return ["ok", len(self._data)]
        raise ProtocolError(f"unknown store request {verb!r:.40}")

    def _put(self, key: Any, value: bytes) -> None:
        if not isinstance(key, str):
            raise ProtocolError("a store key must be a string")
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise ProtocolError(f"the store holds {MAX_KEYS} keys already")
        self._data[key] = value
        self._cond.notify_all()

    def _wait_for(self, keys: list[Any], timeout: Any) -> list[Any] | None:
        """None once every key is there (the condition held); an error answer at the timeout or on close."""
        if not isinstance(timeout, (int, float)) or not all(isinstance(k, str) for k in keys):
            raise ProtocolError("a store wait needs string keys and a timeout in seconds")
        deadline = time.monotonic() + max(0.0, min(float(timeout), 86400.0))
        while not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                return ["timeout", f"keys {keys[:4]} not set within {timeout:g} s"]
            self._cond.wait(left)
        return None


class AuthStore(dist.Store):
    """A ``torch.distributed.Store`` over a :class:`StoreServer`: what ``ProcessGroupGloo`` rendezvouses on."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float) -> None:
        super().__init__()
        self._timeout_s = timeout
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=min(timeout, 30.0))
        except OSError as exc:
            raise ConnectError(f"cannot reach the process group's store at {host}:{port}: {exc}") from None
        try:
            ns = _recv_exact(self._sock, 16)
            nc = os.urandom(16)
            self._sock.sendall(nc + _mac(secret, b"client", ns, nc))
            proof = _recv_exact(self._sock, 32)
        except OSError as exc:
            self._sock.close()
            raise AuthenticationError(f"the process group's store at {host}:{port} refused this node's proof of "
                                      f"the group secret ({exc}); do all nodes share one cluster token?") from None
        if not hmac.compare_digest(proof, _mac(secret, b"server", ns, nc)):
            self._sock.close()
            raise AuthenticationError(f"the store at {host}:{port} does not know the group secret; it is not "
                                      "this cluster's")
        self._sock.settimeout(None)

    def close(self) -> None:
        """Close the connection (the group formed, or gave up)."""
        self._sock.close()

    def _call(self, *req: Any) -> Any:
        with self._lock:
            _send(self._sock, list(req))
            answer = _recv(self._sock)
        if not isinstance(answer, list) or not answer:
            raise ProtocolError("the process group's store sent a malformed answer")
        if answer[0] == "timeout":
            raise dist.DistStoreError(f"process group store: {answer[1]}")
        return answer[1] if len(answer) > 1 else None

    @staticmethod
    def _bytes(value: Any) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def _wait_s(self, timeout: datetime.timedelta | None = None) -> float:
        return timeout.total_seconds() if timeout is not None else self._timeout_s

    def set(self, key: str, value: Any) -> None:  # noqa: D102 - torch.distributed.Store's API
        self._call("set", key, self._bytes(value))

    def get(self, key: str) -> bytes:  # noqa: D102
        return bytes(self._call("get", key, self._timeout_s))

    def add(self, key: str, value: int) -> int:  # noqa: D102
        return int(self._call("add", key, int(value)))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # noqa: D102
        return bytes(self._call("cas", key, self._bytes(expected), self._bytes(desired)))

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # noqa: D102
        self._call("wait", list(keys), self._wait_s(timeout))

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return bool(self._call("del", key))

    def num_keys(self) -> int:  # noqa: D102
        return int(self._call("num"))
