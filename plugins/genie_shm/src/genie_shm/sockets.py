"""Socket helpers of the shm channel: buffered exact reads, file descriptors over Unix sockets."""

from __future__ import annotations

import array
import os
import socket
import struct
import time

from genie.errors import TransportError

_READ_BUFFER = 256 << 10


class Reader:
    """Buffered exact reads from a stream socket: one recv brings a small record's header and body."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_READ_BUFFER)
        self.mv = memoryview(self.buf)
        self.pos = self.end = 0

    def read_into(self, view: memoryview) -> None:
        want, got = view.nbytes, 0
        if self.pos < self.end:
            got = min(want, self.end - self.pos)
            view[:got] = self.mv[self.pos:self.pos + got]
            self.pos += got
        while got < want:
            if want - got >= len(self.buf):  # large: straight into the caller's memory
                n = self.sock.recv_into(view[got:], want - got, socket.MSG_WAITALL)
                if n == 0:
                    raise EOFError(got, want)
                got += n
                continue
            n = self.sock.recv_into(self.mv, len(self.buf))
            if n == 0:
                raise EOFError(got, want)
            take = min(n, want - got)
            view[got:got + take] = self.mv[:take]
            got += take
            self.pos, self.end = take, n


def recv_fds(sock: socket.socket, count: int, deadline: float) -> tuple[list[int], bytes]:
    """Receive ``count`` file descriptors (SCM_RIGHTS) and the bytes sent with them."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(64, socket.CMSG_SPACE(count * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if len(fds) != count or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"expected {count} file descriptors in the shm hand-over, got {len(fds)}")
    return list(fds), data


def recv_fd(sock: socket.socket, deadline: float) -> tuple[int, int]:
    """The server's ring: its fd and announced size."""
    fds, data = recv_fds(sock, 1, deadline)
    if len(data) != 8:
        os.close(fds[0])
        raise TransportError("malformed shm hand-over from the server")
    return fds[0], struct.unpack("<Q", data)[0]


def shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
