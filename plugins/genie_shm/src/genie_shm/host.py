"""Is the peer on this host? The checks behind shm's probe, connect and accept.

Two processes can share memory only under one kernel, and genie's segment
hand-over uses abstract Unix sockets, which also need one network namespace.
:func:`host_identity` names both (the kernel's boot id and the network
namespace's inode); :func:`is_local_address` tells, without sending a packet,
whether an address belongs to this host (the kernel lets a socket bind only to
its own addresses).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_identity() -> tuple[bytes, int]:
    """(boot id as 16 bytes, network namespace inode): equal in two processes iff they can share segments here."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        boot = b"\0" * 16  # no /proc: never equal to a real boot id, so a Linux peer refuses
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return boot, netns


def resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def is_local_address(host: str) -> tuple[bool, str]:
    """Whether ``host`` is an address of this host (network namespace), and why not when it is not."""
    if not host:
        return False, "no peer address given"
    addresses = resolve(host)
    if not addresses:
        return False, f"{host!r} does not resolve"
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
            return True, ""
    return False, (f"{host} ({', '.join(addresses)}) is not an address of this host; shared memory works only "
                   "between processes on one host")
