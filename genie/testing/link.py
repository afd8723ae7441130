"""A link emulator: a userspace TCP proxy that makes loopback behave like a real network path.

This kernel has no netem, and every genie test would otherwise run where a round trip is free.
:class:`LinkEmulator` listens on a local port and forwards each accepted connection to one
target, holding every byte for ``delay`` seconds each way (so a round trip costs ``2 * delay``),
pacing each direction at ``rate`` bytes per second when given, and doing to the path on command
what real networks do to it:

- :meth:`~LinkEmulator.cut`: every open connection is reset at once (RST to both ends), as when a
  NAT forgets its mapping or a Wi-Fi link drops;
- :meth:`~LinkEmulator.stall` / :meth:`~LinkEmulator.resume`: bytes stop flowing but the
  connections stay open (a congested or flapping link), and flow again in order;
- :meth:`~LinkEmulator.down` / :meth:`~LinkEmulator.up`: an outage: open connections are cut and
  new ones are reset as they arrive, until ``up()`` (or the outage's ``seconds`` pass).

It also stands in for a NAT or a container's port mapping: the proxy's port is not the target's,
so a node behind it must advertise the proxy's address (``--advertise-host``).

Only for tests and benchmarks on this machine: it binds loopback unless told otherwise, and each
connection costs four threads. Bytes queued per direction are bounded (``buffer`` bytes, plus what
``rate * delay`` keeps in flight), after which the reading side waits: TCP's own back-pressure.

Example::

    with LinkEmulator(("127.0.0.1", node_port), delay=0.015) as link:    # 30 ms round trips
        sock = socket.create_connection(("127.0.0.1", link.port))
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import struct
import threading
import time

import attrs

log = logging.getLogger("genie.testing")

__all__ = ["LinkEmulator", "LinkStats"]

_CHUNK = 256 << 10
_EOF = b""


@attrs.frozen
class LinkStats:
    """What a :class:`LinkEmulator` carried so far."""

    connections: int  #: accepted and forwarded
    open: int  #: forwarded and still open
    refused: int  #: reset on arrival while the link was down
    cuts: int  #: connections reset by cut() or down()
    bytes_up: int  #: client to target
    bytes_down: int  #: target to client


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the peer sees ECONNRESET, as on a dropped path, not a clean FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # A thread blocked in recv() on this socket keeps it open past close() (the kernel's reference), so the
    # RST would wait for the peer's next byte: shutting the read side first wakes that thread, then the last
    # reference goes and the RST leaves at once.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


class _Direction:
    """One direction of one connection: a reader that stamps each chunk with its due time, a writer that sends it then."""

    def __init__(self, link: LinkEmulator, pipe: _Pipe, src: socket.socket, dst: socket.socket, name: str) -> None:
        self.link, self.pipe, self.src, self.dst, self.name = link, pipe, src, dst, name
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.free_at = 0.0  # when the paced link finishes serialising what was queued
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._read, name=f"genie-link-{name}-read", daemon=True),
                        threading.Thread(target=self._write, name=f"genie-link-{name}-write", daemon=True)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _due(self, n: int) -> float:
        now = time.monotonic()
        delay, rate = self.link.delay, self.link.rate
        if rate:
            self.free_at = max(now, self.free_at) + n / rate
            return self.free_at + delay
        return now + delay

    def _read(self) -> None:
        try:
            while not self.pipe.closed:
                data = self.src.recv(_CHUNK)
                with self.cond:
                    limit = self.link.buffer + int((self.link.rate or 0) * self.link.delay)
                    while self.queued >= limit and not self.pipe.closed:
                        self.cond.wait(0.05)
                    self.queue.append((self._due(len(data)), data))
                    self.queued += len(data)
                    self.cond.notify_all()
                if not data:
                    return
        except OSError:
            self.pipe.fail()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.pipe.closed:
                        if self.queue and not self.link.stalled:
                            wait = self.queue[0][0] - time.monotonic()
                            if wait <= 0:
                                break
                            self.cond.wait(wait)
                        else:
                            self.cond.wait(0.05 if self.link.stalled else None)
                    if self.pipe.closed:
                        return
                    _, data = self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
                if data is _EOF or not data:
                    with contextlib.suppress(OSError):
                        self.dst.shutdown(socket.SHUT_WR)
                    self.pipe.half_closed()
                    return
                self.link._count(self.name, len(data))  # before the send: a peer that has the bytes sees them counted
                self.dst.sendall(data)
        except OSError:
            self.pipe.fail()


class _Pipe:
    """One forwarded connection: the client's socket, the target's, and a direction each way."""

    def __init__(self, link: LinkEmulator, client: socket.socket, target: socket.socket) -> None:
        self.link, self.client, self.target = link, client, target
        self.closed = False
        self._halves = 0
        self._lock = threading.Lock()
        self.directions = (_Direction(link, self, client, target, "up"), _Direction(link, self, target, client, "down"))

    def start(self) -> None:
        for d in self.directions:
            d.start()

    def wake(self) -> None:
        for d in self.directions:
            d.wake()

    def half_closed(self) -> None:
        with self._lock:
            self._halves += 1
            done = self._halves == 2
        if done:
            self.close(reset=False)

    def fail(self) -> None:
        self.close(reset=True)

    def close(self, *, reset: bool) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.target):
            if reset:
                _reset(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()
        self.wake()
        self.link._forget(self)


class LinkEmulator:
    """A delaying, pacing, breakable TCP proxy to ``target``; see the module docstring.

    :param target: ``(host, port)`` each accepted connection is forwarded to.
    :param delay: seconds added to every byte in each direction (the round trip grows by twice this).
    :param rate: bytes per second in each direction, or None for no cap.
    :param host: address to listen on (loopback by default); ``port`` 0 picks a free one.
    :param buffer: bytes queued per direction before the reading side waits.
    """

    def __init__(self, target: tuple[str, int], *, delay: float = 0.0, rate: float | None = None,
                 host: str = "127.0.0.1", port: int = 0, buffer: int = 8 << 20) -> None:
        if delay < 0 or (rate is not None and rate <= 0):
            raise ValueError(f"LinkEmulator: delay must be >= 0 s and rate > 0 bytes/s (got delay={delay}, "
                             f"rate={rate})")
        self.target = target
        self.delay = delay
        self.rate = rate
        self.buffer = buffer
        self.stalled = False
        self._down_until: float | None = None
        self._lock = threading.Lock()
        self._pipes: set[_Pipe] = set()
        self._counts = {"connections": 0, "refused": 0, "cuts": 0, "up": 0, "down": 0}
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._accepter = threading.Thread(target=self._accept_loop, name="genie-link-accept", daemon=True)
        self._accepter.start()

    def __repr__(self) -> str:
        return (f"LinkEmulator({self.host}:{self.port} -> {self.target[0]}:{self.target[1]}, "
                f"delay={self.delay * 1e3:g} ms each way, rate={self.rate})")

    def __enter__(self) -> LinkEmulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect: ``(host, port)``."""
        return self.host, self.port

    def configure(self, *, delay: float | None = None, rate: float | None = None) -> None:
        """Change the delay (seconds each way) or the rate (bytes/s) for bytes that arrive from now on."""
        if delay is not None:
            self.delay = delay
        if rate is not None:
            self.rate = rate

    def cut(self) -> int:
        """Reset every open connection (both ends see ECONNRESET); the number cut. New connections still pass."""
        with self._lock:
            pipes = list(self._pipes)
            self._counts["cuts"] += len(pipes)
        for pipe in pipes:
            pipe.close(reset=True)
        return len(pipes)

    def stall(self) -> None:
        """Hold every byte (connections stay open) until :meth:`resume`."""
        self.stalled = True

    def resume(self) -> None:
        """Let held bytes flow again, in order, each no earlier than its own due time."""
        self.stalled = False
        with self._lock:
            pipes = list(self._pipes)
        for pipe in pipes:
            pipe.wake()

    def down(self, seconds: float | None = None) -> int:
        """An outage: cut what is open and reset new connections until :meth:`up` or ``seconds`` pass."""
        self._down_until = float("inf") if seconds is None else time.monotonic() + seconds
        return self.cut()

    def up(self) -> None:
        """End an outage now."""
        self._down_until = None

    @property
    def is_down(self) -> bool:
        """Whether new connections are being reset."""
        until = self._down_until
        return until is not None and time.monotonic() < until

    def stats(self) -> LinkStats:
        """Counts so far."""
        with self._lock:
            c = dict(self._counts)
            open_ = len(self._pipes)
        return LinkStats(c["connections"], open_, c["refused"], c["cuts"], c["up"], c["down"])

    def close(self) -> None:
        """Stop accepting and reset every open connection."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._accepter.join(2.0)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            pipes = list(self._pipes)
        for pipe in pipes:
            pipe.close(reset=True)

    # -- internals ---------------------------------------------------------------------------------

    def _count(self, direction: str, n: int) -> None:
        with self._lock:
            self._counts[direction] += n

    def _forget(self, pipe: _Pipe) -> None:
        with self._lock:
            self._pipes.discard(pipe)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            ready, _, _ = select.select([self._listener], [], [], 0.05)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE and friends: say so, back off, go on
                log.warning("link emulator %s: accept failed (%s); retrying", self, exc)
                time.sleep(0.05)
                continue
            client.setblocking(True)
            if self.is_down:
                with self._lock:
                    self._counts["refused"] += 1
                _reset(client)
                continue
            threading.Thread(target=self._forward, args=(client,), name="genie-link-connect", daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        # Connecting also crosses the link: the SYN/SYN-ACK round trip costs one round trip.
        time.sleep(2 * self.delay)
        try:
            target = socket.create_connection(self.target, timeout=10.0)
        except OSError as exc:
            log.info("link emulator %s: target unreachable (%s); resetting the client", self, exc)
            _reset(client)
            return
        target.settimeout(None)
        for sock in (client, target):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe = _Pipe(self, client, target)
        with self._lock:
            if self._closed.is_set() or self.is_down:  # closed or cut while this connection was being set up
                pipe_ok = False
            else:
                self._pipes.add(pipe)
                self._counts["connections"] += 1
                pipe_ok = True
        if not pipe_ok:
            _reset(client)
            _reset(target)
            return
        pipe.start()
