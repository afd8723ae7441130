"""A cache of genie's entry points, so plugin discovery costs a few stats instead of reading every distribution.

``importlib_metadata.entry_points(group="genie")`` reads and parses the metadata of every
installed distribution (12-15 ms at each ``genie.init`` with torch's environment). The entry
points found are kept in ``$GENIE_CACHE_DIR/entry_points-<environment>.json`` (the capability cache's
directory, :func:`genie.transport.cache.default_cache_dir`) under a *fingerprint* of what is
installed: the Python version and prefix, and for each directory on ``sys.path`` the names of
the ``*.dist-info`` / ``*.egg-info`` in it with the modification time of each one's
``entry_points.txt`` (not the directory's own time: files written beside a script move it). Installing, upgrading or removing a distribution adds or renames
such a directory (the version is part of its name); ``pip install -e`` rewrites
``entry_points.txt``: either changes the fingerprint, and the next discovery reads the
metadata again. ``GENIE_CAPABILITY_CACHE=0`` switches this cache off too.

A cached entry point is loaded the way ``importlib.metadata`` loads one (``module:attr`` imported
and looked up); values that are not dotted identifiers are never cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import attrs
import importlib_metadata

from genie.transport.cache import cache_enabled, default_cache_dir

log = logging.getLogger("genie.plugins")

def _file_name() -> str:
    """One file per environment (interpreter and prefix): two virtual environments on a host sharing one
    file would overwrite each other's entries at every init and never hit."""
    tag = hashlib.sha256(f"{sys.version}\0{sys.prefix}".encode()).hexdigest()[:16]
    return f"entry_points-{tag}.json"


#: This environment's cache file, in the capability cache's directory.
FILE_NAME = _file_name()
_FORMAT = 1
#: ``package.module:attr.attr`` (an entry point value as importlib.metadata loads it, no extras).
_VALUE = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$")


@attrs.frozen
class CachedDistribution:
    """The distribution an entry point came from (what plugin records need of it)."""

    name: str
    version: str


@attrs.frozen
class CachedEntryPoint:
    """An entry point as found by importlib.metadata, kept in the cache."""

    name: str
    value: str
    group: str
    dist: CachedDistribution | None

    def load(self) -> Any:
        """Import the module and look the attribute up, as ``importlib.metadata.EntryPoint.load`` does."""
        return importlib_metadata.EntryPoint(self.name, self.value, self.group).load()


def fingerprint() -> list[Any]:
    """What the installed distributions look like, cheaply (see the module docstring)."""
    out: list[Any] = [sys.version, sys.prefix]
    for entry in sys.path:
        path = entry or os.getcwd()
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):  # a zip file on the path
            out.append([path, st.st_mtime_ns])
            continue
        try:
            with os.scandir(path) as it:
                names = sorted(e.name for e in it if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:
            names = []
        # Not the directory's own mtime: every file written beside a script (logs, checkpoints) moves it,
        # and a distribution can only add entry points through a *-info directory, listed here by name.
        found: list[Any] = [path]
        for name in names:
            try:
                found.append([name, os.stat(os.path.join(path, name, "entry_points.txt")).st_mtime_ns])
            except OSError:
                found.append([name, -1])
        out.append(found)
    return out


def _discover(group: str) -> list[CachedEntryPoint]:
    found = []
    for ep in importlib_metadata.entry_points(group=group):
        dist = CachedDistribution(ep.dist.name, ep.dist.version) if ep.dist is not None else None
        found.append(CachedEntryPoint(ep.name, ep.value, group, dist))
    return found


def _decode(entries: Any, group: str) -> list[CachedEntryPoint] | None:
    if not isinstance(entries, list):
        return None
    out = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4 and all(isinstance(v, str) for v in e[:2])
                and _VALUE.match(e[1]) and (e[2] is None or isinstance(e[2], str))
                and (e[3] is None or isinstance(e[3], str))):
            return None
        out.append(CachedEntryPoint(e[0], e[1], group, None if e[2] is None else CachedDistribution(e[2], e[3] or "")))
    return out


def entry_points(group: str, environ: Mapping[str, str] | None = None) -> list[CachedEntryPoint]:
    """The entry points of ``group``: from the cache when what is installed has not changed, else found anew."""
    env = os.environ if environ is None else environ
    if not cache_enabled(env):
        return _discover(group)
    path = default_cache_dir(env) / FILE_NAME
    key = fingerprint()
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("format") == _FORMAT and data.get("fingerprint") == key:
            cached = _decode(data.get("groups", {}).get(group), group)
            if cached is not None:
                return cached
    found = _discover(group)
    if all(_VALUE.match(ep.value) for ep in found):
        entries = [[ep.name, ep.value, ep.dist.name if ep.dist else None, ep.dist.version if ep.dist else None]
                   for ep in found]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".entry_points-")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": _FORMAT, "fingerprint": key, "groups": {group: entries}}, f)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError as exc:
            log.debug("entry point cache not written to %s: %s", path, exc)
    return found
