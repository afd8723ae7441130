"""Carrying a TLS session between the node and its session worker.

The node runs the whole handshake before it assigns a worker (genie.server.preauth), TLS
included, and TLS state cannot move to another process. So a TLS session's worker gets one
end of a fresh loopback TCP connection, and the node carries the plaintext between the
client's TLS channel and the other end on two threads (:class:`TlsRelay`). Plain sessions
never take this hop: their socket itself goes to the worker.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any

from genie.errors import GenieError
from genie.transport.features import inner_of, relay_stream_of, tls_of

log = logging.getLogger("genie.server.isolation")

#: Bytes moved per receive (a TLS record is at most 16 KiB; the worker's side may give more).
CHUNK = 1 << 20


def tls_stream(channel: Any) -> Any | None:
    """The TLS byte stream under ``channel`` (itself, or the channel under a layered one), None when plain:
    a stream that declares both TLS (in use) and RelayStream (partial receives, a descriptor to poll)."""
    for stream in (channel, inner_of(channel)):
        tls = tls_of(stream)
        if tls is not None and tls.tls_version and relay_stream_of(stream) is not None:
            return stream
    return None


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of TCP sockets on 127.0.0.1 (the worker's channel is built for a TCP socket)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        while True:  # a local stranger racing to connect first is closed, not served
            theirs, address = server.accept()
            if address == ours.getsockname():
                return ours, theirs
            theirs.close()


class TlsRelay:
    """Moves plaintext between ``stream`` (the client's TLS channel) and ``sock`` (the worker's pair end)."""

    def __init__(self, stream: Any, sock: socket.socket, name: str) -> None:
        self.stream = stream
        self.sock = sock
        stream.settimeout(None)
        self._threads = [threading.Thread(target=self._down, name=f"{name}-relay-in", daemon=True),
                         threading.Thread(target=self._up, name=f"{name}-relay-out", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _down(self) -> None:
        """Client to worker; the client's EOF becomes the worker's."""
        buf = memoryview(bytearray(CHUNK))
        try:
            while n := self.stream.recv_some(buf):
                self.sock.sendall(buf[:n])
        except (GenieError, OSError) as exc:
            log.debug("relay from %s ended: %s", self.stream.peer, exc)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def _up(self) -> None:
        """Worker to client, until the worker closes its end (the session's end closes the TLS channel)."""
        buf = memoryview(bytearray(CHUNK))
        try:
            while n := self.sock.recv_into(buf):
                self.stream.sendv([buf[:n]])
        except (GenieError, OSError) as exc:
            log.debug("relay to %s ended: %s", self.stream.peer, exc)
        with contextlib.suppress(OSError):
            self.sock.close()
