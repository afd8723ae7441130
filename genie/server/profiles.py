"""Session profiles: where a session's time went on the node, op by op and kernel by kernel.

``genie serve --profile-sessions DIR`` (``GENIE_PROFILE_SESSIONS``) runs each session worker under
``torch.profiler`` (CPU activity, and CUDA's where the node serves a GPU) from its first command to its
end, then writes two files into ``DIR``:

- ``session-N.txt``: torch's own table of the session's ops and kernels, the largest first;
- ``session-N.json``: :func:`summary`: the session's wall time, the CPU time of its ATen ops, the
  device's busy time (the sum of its kernels', copies' and fills' times) and the largest rows.

What it answers: is the GPU waiting for the node (device time well below the wall), or busy with more
or other kernels than a local run launches (compare with :func:`summary` of the same steps run locally
under ``torch.profiler``: ``benchmarks/bench_gpu.py --profile``)?

The node's own checks are ops too: the pre-flight of each new op signature on meta tensors
(:mod:`genie.server.preflight`) shows as one more call of that op, at no device time.

A diagnostic mode, for a node whose operator is looking: the profiler keeps every event of the session
in the worker's memory until it ends (a few hundred bytes an op) and adds some microseconds to each op.
One profiler runs per process, so sessions must have processes of their own: ``isolation = process``
(the node refuses the option with ``none``). The file names come from the node's session ids, never
from anything a client sends.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from genie.errors import ConfigError

#: Rows of the JSON summary and the text table.
TOP_ROWS = 60


def check_directory(path: str, isolation: str, source: str) -> Path | None:
    """The profile directory of a node's config (created if missing), None when profiling is off; a
    ConfigError naming the fix when it cannot be used."""
    if not path:
        return None
    if isolation != "process":
        raise ConfigError("profile_sessions", path, source,
                          "a directory with isolation = process (one profiler runs per process, so sessions in "
                          "threads of the node cannot be profiled apart); drop --isolation none or the profile")
    directory = _resolve(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("profile_sessions", path, source, f"a directory this node can create ({exc.strerror})") \
            from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError("profile_sessions", path, source, "a directory this node's user can write")
    return directory


def _resolve(path: str | Path) -> Path:
    """The directory a configured path names (``~`` expanded): the node checks it, its workers write there."""
    return Path(path).expanduser()


def summary(averages: Any, wall_s: float, **about: Any) -> dict[str, Any]:
    """What a finished ``torch.profiler.profile`` measured (``averages``: its ``key_averages()``), as plain data:
    ``wall_s`` (given: the profiled span), ``cpu_op_s`` (the self CPU time of every CPU event), ``device_s`` (the
    self time of every device event: kernels, copies, fills), ``host_to_device_s`` (the part of it that copied host
    memory in: uploads), ``kernels`` (how many device events ran) and the ``rows`` with the most time, device time
    first, each ``{name, count, self_cpu_us, self_device_us, device}``."""
    cpu = device = uploads = 0.0
    kernels = 0
    rows = []
    for event in averages:
        kind = _device_type(event)
        self_cpu = float(event.self_cpu_time_total)
        self_device = float(_self_device_time(event))
        if kind != "CPU":
            device += self_device
            kernels += int(event.count)
            if event.key.startswith("Memcpy HtoD"):
                uploads += self_device
        else:
            cpu += self_cpu
        rows.append({"name": event.key, "count": int(event.count), "self_cpu_us": round(self_cpu, 1),
                     "self_device_us": round(self_device, 1), "device": kind.lower()})
    rows.sort(key=lambda r: (r["self_device_us"], r["self_cpu_us"]), reverse=True)
    return {**about, "wall_s": wall_s, "cpu_op_s": cpu / 1e6, "device_s": device / 1e6,
            "host_to_device_s": uploads / 1e6, "kernels": kernels, "rows": rows[:TOP_ROWS]}


def _device_type(event: Any) -> str:
    return str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1]


def _self_device_time(event: Any) -> float:
    # torch 2.4 renamed the cuda_* timings device_*; the GPU image's torch and the pinned one both have these
    return getattr(event, "self_device_time_total", 0.0) or 0.0


def write(directory: Path, name: str, averages: Any, data: dict[str, Any]) -> Path:
    """``name``.json (``data``) and ``name``.txt (torch's table of ``averages``) in ``directory``, each written whole
    before it appears (a reader polling for the JSON never sees half of it); returns the JSON's path."""
    sort = "self_device_time_total" if data.get("device_s") else "self_cpu_time_total"
    table = averages.table(sort_by=sort, row_limit=TOP_ROWS)
    _replace(directory / f"{name}.txt", table)
    return _replace(directory / f"{name}.json", json.dumps(data, indent=1))


def _replace(path: Path, text: str) -> Path:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
    return path


@contextlib.contextmanager
def profiled(directory: str | Path | None, name: str, devices: Sequence[Any], **about: Any) -> Iterator[None]:
    """Run the body (a session worker's session; in bench_gpu, a local run to compare with) under
    ``torch.profiler`` and write its profile into ``directory`` (a node's ``profile_sessions``, as
    :func:`check_directory` made it) as ``name``.json and .txt, the JSON with ``about``; nothing when
    ``directory`` is empty or None."""
    if not directory:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = any(str(d).startswith("cuda") for d in devices)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiler = profile(activities=activities)
    profiler.start()
    started = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            with contextlib.suppress(Exception):  # a lost context: write what was recorded
                torch.cuda.synchronize()
        wall = time.perf_counter() - started
        profiler.stop()
        averages = profiler.key_averages()  # once: over a long session's events it takes a while
        data = summary(averages, wall, **about, pid=os.getpid(), devices=[str(d) for d in devices])
        write(_resolve(directory), name, averages, data)
