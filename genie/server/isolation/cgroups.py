"""cgroups v2 for session workers: a cgroup per worker with ``memory.max`` and ``cpu.weight``, when writable.

:func:`probe` decides once per node whether limits can be enforced: the unified
hierarchy must be mounted (``cgroup.controllers`` at its root), our own cgroup
(``0::/path`` in ``/proc/self/cgroup``) must offer the ``memory`` and ``cpu``
controllers, and we must be able to make a child group ``genie-<pid>`` under it and
enable both controllers for its children. Otherwise every session still has its own
process (so its memory is freed when it dies) and the per-session byte quota
(``max_session_bytes``, counted by the store) is the only memory limit; :attr:`Cgroups.summary`
says which, and ``genie serve`` prints it.

A worker's group is removed when the worker is gone. The kernel kills a worker that
goes past ``memory.max`` (SIGKILL, counted in ``memory.events`` as ``oom_kill``), so
the supervisor reads :meth:`Cgroups.oom_killed` to tell the client it was the memory limit.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import attrs

log = logging.getLogger("genie.server.isolation")

_NEEDED = ("memory", "cpu")


@attrs.define
class Cgroups:
    """The node's worker cgroups (:attr:`base` is None when limits are not enforced; :attr:`reason` says why)."""

    base: Path | None
    memory_max: int  #: bytes (0: no memory limit, ``max``)
    cpu_weight: int
    reason: str = ""

    @property
    def enforced(self) -> bool:
        """True when each worker gets a cgroup with these limits."""
        return self.base is not None

    @property
    def summary(self) -> str:
        """One line for the operator: which limits are enforced, or why none."""
        if self.base is None:
            return f"cgroups not writable ({self.reason}): memory limits by quota accounting only"
        memory = str(self.memory_max) if self.memory_max else "max"
        return f"cgroup memory.max={memory}, cpu.weight={self.cpu_weight}"

    def attach(self, name: str, pid: int) -> Path | None:
        """Make the group ``name`` with the limits and move ``pid`` into it; None when not enforced or it fails."""
        if self.base is None:
            return None
        group = self.base / name
        try:
            group.mkdir(exist_ok=True)
            (group / "memory.max").write_text(str(self.memory_max) if self.memory_max else "max")
            (group / "cpu.weight").write_text(str(self.cpu_weight))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            log.warning("cannot put session worker %d in cgroup %s (%s): its memory is bounded by quota only",
                        pid, group, exc)
            self.release(group)
            return None
        return group

    @staticmethod
    def oom_killed(group: Path | None) -> bool:
        """True when the kernel killed a process of ``group`` for going past ``memory.max``."""
        if group is None:
            return False
        try:
            for line in (group / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    @staticmethod
    def release(group: Path | None) -> None:
        """Remove a worker's group (its processes are gone); a leftover is logged, never raised."""
        if group is None:
            return
        try:
            group.rmdir()
        except OSError as exc:
            log.debug("cgroup %s not removed: %s", group, exc)


def own_cgroup(proc_self_cgroup: str = "/proc/self/cgroup") -> str | None:
    """Our path in the unified hierarchy (``0::/path``), or None when we have none."""
    try:
        for line in Path(proc_self_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                return line[3:] or "/"
    except OSError:
        return None
    return None


def probe(memory_max: int, cpu_weight: int, *, root: str = "/sys/fs/cgroup",
          proc_self_cgroup: str = "/proc/self/cgroup") -> Cgroups:
    """Find out whether worker cgroups can be made here; see the module docstring."""
    top = Path(root)
    if not (top / "cgroup.controllers").exists():
        return Cgroups(None, memory_max, cpu_weight, f"{root} is not a cgroup v2 (unified) mount")
    path = own_cgroup(proc_self_cgroup)
    if path is None:
        return Cgroups(None, memory_max, cpu_weight, "this process is in no cgroup v2 group")
    mine = top / path.lstrip("/")
    try:
        offered = (mine / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return Cgroups(None, memory_max, cpu_weight, f"cannot read {mine}/cgroup.controllers: {exc.strerror}")
    missing = [c for c in _NEEDED if c not in offered]
    if missing:
        return Cgroups(None, memory_max, cpu_weight, f"controller {', '.join(missing)} not available in {mine}")
    base = mine / f"genie-{os.getpid()}"
    try:
        base.mkdir(exist_ok=True)
        (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in _NEEDED))
    except OSError as exc:
        with contextlib.suppress(OSError):
            base.rmdir()
        return Cgroups(None, memory_max, cpu_weight, f"cannot make {base}: {exc.strerror or exc}")
    return Cgroups(base, memory_max, cpu_weight)
