"""The host-capability cache: probe results that depend only on this host.

Probing DPDK starts an EAL in a subprocess and probing RDMA imports pyverbs in
another; neither answer changes unless the host changes. A transport that says
so (``Transport.host_fingerprint()`` returns a dict) has its result cached under a
key made of that dict plus what every result depends on: the genie and plugin
versions, the transport class, the torch version, ``CUDA_VISIBLE_DEVICES``, the
Python interpreter and ``/etc/ld.so.cache`` (rewritten by ``ldconfig`` whenever a
library package is installed). A changed key is a miss; nothing is ever served
stale on purpose.

Two levels: a dict in this process, and a JSON file shared by the processes of
one user, ``$GENIE_CACHE_DIR/capabilities.json`` (default
``$XDG_CACHE_HOME/genie`` or ``~/.cache/genie``). ``GENIE_CAPABILITY_CACHE=0``
turns both off. Results that say ``timeout`` or ``error`` are never stored:
they are accidents, not capabilities. Results that depend on the peer (TCP's
round trip) are never cached at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import importlib_metadata

from genie.types import Figure, ProbeResult

log = logging.getLogger("genie.transport.cache")

CACHE_FORMAT = 1
#: An entry older than this is a miss even when its key matches (a safety net, not the mechanism).
MAX_AGE_S = 7 * 24 * 3600.0
#: Reason codes that describe an accident of this run rather than the host.
UNCACHEABLE_REASONS = frozenset({"timeout", "error"})

#: Where shared libraries are looked for when fingerprinting (after LD_LIBRARY_PATH).
LIBRARY_DIRS = (
    "/usr/local/lib",
    "/usr/local/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
)


def path_fingerprint(paths: Iterable[str | os.PathLike[str]]) -> list[list[Any]]:
    """``[path, mtime_ns, size]`` for each path (``[path, None, None]`` when it does not exist).

    For plugins' ``host_fingerprint``: cheap (one ``stat`` each), and it changes when a
    library is installed, upgraded or removed.
    """
    out: list[list[Any]] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append([os.fspath(path), None, None])
        else:
            out.append([os.fspath(path), st.st_mtime_ns, st.st_size])
    return out


def library_dirs() -> list[str]:
    """``LD_LIBRARY_PATH`` entries, then the system library directories.

    The system directories are :data:`LIBRARY_DIRS` unless ``GENIE_SYSTEM_LIBRARY_DIRS`` is set (a
    path list; empty means none): for a site whose libraries live elsewhere, and for checking what a
    machine without the system packages sees (tests/test_first_contact.py).
    """
    extra = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    given = os.environ.get("GENIE_SYSTEM_LIBRARY_DIRS")
    system = LIBRARY_DIRS if given is None else tuple(d for d in given.split(os.pathsep) if d)
    return extra + [d for d in system if d not in extra]


def find_library_file(*names: str) -> str | None:
    """The first existing file called one of ``names`` in :func:`library_dirs` (no dlopen, no ldconfig)."""
    for directory in library_dirs():
        for name in names:
            candidate = os.path.join(directory, name)
            if os.path.exists(candidate):
                return candidate
    return None


def listing_fingerprint(directory: str) -> list[str] | None:
    """Sorted entry names of ``directory`` (None when it does not exist), e.g. ``/sys/class/infiniband``."""
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return None


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$GENIE_CACHE_DIR``, else ``$XDG_CACHE_HOME/genie``, else ``~/.cache/genie``."""
    env = os.environ if environ is None else environ
    if env.get("GENIE_CACHE_DIR"):
        return Path(env["GENIE_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "genie"


def cache_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``GENIE_CAPABILITY_CACHE`` is ``0``, ``false``, ``no`` or ``off``."""
    env = os.environ if environ is None else environ
    return env.get("GENIE_CAPABILITY_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


_torch_version: str | None = None


def _torch_version_text() -> str:
    global _torch_version
    if _torch_version is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            _torch_version = str(getattr(torch, "__version__", ""))
        else:
            try:
                _torch_version = importlib_metadata.version("torch")
            except importlib_metadata.PackageNotFoundError:
                _torch_version = "absent"
    return _torch_version


def common_fingerprint(plugin_versions: Mapping[str, str]) -> dict[str, Any]:
    """What every cached result depends on besides the transport's own fingerprint."""
    return {
        "format": CACHE_FORMAT,
        "plugins": dict(sorted(plugin_versions.items())),
        "python": sys.executable,
        "torch": _torch_version_text(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
        "ld_so_cache": path_fingerprint(["/etc/ld.so.cache"]),
    }


def cache_key(transport: type, fingerprint: Mapping[str, Any], common: Mapping[str, Any]) -> str:
    """A stable hash of the transport class, its fingerprint and the common parts."""
    doc = {
        "transport": f"{transport.__module__}.{transport.__qualname__}",
        "host": fingerprint,
        "common": common,
    }
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def result_from_dict(data: Mapping[str, Any]) -> ProbeResult:
    """The inverse of :meth:`ProbeResult.to_dict`."""
    return ProbeResult(
        name=str(data["name"]),
        available=bool(data["available"]),
        reason_code=str(data.get("reason_code", "ok")),
        reason=str(data.get("reason", "")),
        priority=int(data.get("priority", 0)),
        figures={
            k: Figure(float(f["value"]), str(f["unit"]), bool(f["measured"]))
            for k, f in dict(data.get("figures", {})).items()
        },
        details=dict(data.get("details", {})),
    )


class CapabilityCache:
    """Probe results by transport name and key, in memory and in one JSON file.

    Thread-safe. A corrupt or unreadable file is logged and treated as empty; a
    failed write is logged and ignored (the cache is an optimisation, never a
    reason for discovery to fail).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, persist: bool = True) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.path = self.directory / "capabilities.json"
        self.persist = persist
        self._lock = threading.Lock()
        self._memory: dict[str, tuple[str, float, ProbeResult]] = {}
        self._file_state: tuple[int, int] | None = None

    def get(self, name: str, key: str) -> ProbeResult | None:
        """The stored result of transport ``name`` if it was stored under ``key`` and is not too old."""
        with self._lock:
            self._load_file_if_changed()
            entry = self._memory.get(name)
        if entry is None or entry[0] != key or time.time() - entry[1] > MAX_AGE_S:
            return None
        return entry[2]

    def put(self, name: str, key: str, result: ProbeResult) -> None:
        """Store ``result`` unless its reason code says it was an accident (timeout, error)."""
        if result.reason_code in UNCACHEABLE_REASONS:
            return
        with self._lock:
            self._load_file_if_changed()
            self._memory[name] = (key, time.time(), result)
            if self.persist:
                self._write_file()

    def clear(self) -> None:
        """Forget everything, in memory and on disk."""
        with self._lock:
            self._memory.clear()
            self._file_state = None
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove capability cache %s: %s", self.path, exc)

    # -- the file ------------------------------------------------------------------------------
    def _load_file_if_changed(self) -> None:
        if not self.persist:
            return
        try:
            st = self.path.stat()
        except OSError:
            return
        state = (st.st_mtime_ns, st.st_size)
        if state == self._file_state:
            return
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("format") != CACHE_FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {CACHE_FORMAT}")
            entries = {
                name: (str(e["key"]), float(e["stored_at"]), result_from_dict(e["result"]))
                for name, e in doc.get("entries", {}).items()
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable capability cache %s: %s", self.path, exc)
            self._file_state = state
            return
        # Entries of this process win over the file's only when the file lacks them.
        entries.update({n: e for n, e in self._memory.items() if n not in entries})
        self._memory = entries
        self._file_state = state

    def _write_file(self) -> None:
        doc = {
            "format": CACHE_FORMAT,
            "entries": {
                name: {"key": key, "stored_at": stored_at, "result": result.to_dict()}
                for name, (key, stored_at, result) in sorted(self._memory.items())
            },
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".capabilities.", dir=self.directory)
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1, sort_keys=True, default=str)
            os.replace(tmp, self.path)
            st = self.path.stat()
            self._file_state = (st.st_mtime_ns, st.st_size)
        except OSError as exc:
            log.warning("could not write capability cache %s: %s", self.path, exc)


_default: CapabilityCache | None = None


def get_capability_cache() -> CapabilityCache:
    """The process-wide cache, in :func:`default_cache_dir` (built on first use)."""
    global _default
    if _default is None or _default.directory != default_cache_dir():
        _default = CapabilityCache()
    return _default
