"""Shared-memory segments: sealed memfd rings, one per direction, owned by their writer.

Each side of a channel creates the ring it *sends* through and hands its file
descriptor to the peer (``SCM_RIGHTS`` over a Unix socket). The ring is sealed
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before it leaves, and the reader
checks the seals and the size before it maps it, read-only: a peer can neither
shrink the segment under the reader (which would kill it with SIGBUS) nor
write into the reader's ring. Positions and credits never live in the segment:
they travel as records over the sockets, whose system calls order the memory
accesses, so no atomics are needed.
"""

from __future__ import annotations

import fcntl
import mmap
import os

from genie.errors import TransportError

#: Seals a ring must carry before a reader maps it.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Largest ring a reader accepts from a peer (bounds what one peer can make us map).
MAX_RING_BYTES = 1 << 30
MIN_RING_BYTES = 1 << 16


def ring_bytes_from_env() -> int:
    """The ring size: ``GENIE_SHM_RING_MB`` (default 16), clear error when malformed or out of range."""
    from genie.errors import ConfigError

    text = os.environ.get("GENIE_SHM_RING_MB", "16")
    try:
        mib = int(text)
    except ValueError:
        raise ConfigError("GENIE_SHM_RING_MB", text, "environment", "an integer number of MiB, 1 to 1024") from None
    if not 1 <= mib <= MAX_RING_BYTES >> 20:
        raise ConfigError("GENIE_SHM_RING_MB", text, "environment", "an integer number of MiB, 1 to 1024")
    return mib << 20


def create_ring(size: int) -> tuple[int, mmap.mmap]:
    """A new sealed memfd of ``size`` bytes and its writable mapping; the caller closes the fd once handed over."""
    fd = os.memfd_create("genie-shm-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
        return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def map_peer_ring(fd: int, size: int) -> mmap.mmap:
    """Map a peer's ring read-only after checking it is a sealed segment of exactly ``size`` bytes.

    Closes ``fd`` in every case. TransportError naming the problem when the peer's segment is unfit.
    """
    try:
        if not MIN_RING_BYTES <= size <= MAX_RING_BYTES:
            raise TransportError(f"peer announced a {size}-byte ring; rings must be {MIN_RING_BYTES} to "
                                 f"{MAX_RING_BYTES} bytes")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise TransportError(f"peer's ring is not a sealable memfd ({exc})") from exc
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise TransportError("peer's ring is not sealed against resizing (F_SEAL_SHRINK|F_SEAL_GROW|"
                                 "F_SEAL_SEAL); refusing to map it")
        actual = os.fstat(fd).st_size
        if actual != size:
            raise TransportError(f"peer's ring has {actual} bytes, not the {size} it announced")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
