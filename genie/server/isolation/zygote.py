"""Worker processes from multiprocessing's forkserver, without re-running the node's ``__main__``.

A forkserver child normally imports the parent's main module again (as ``__mp_main__``) so
pickled functions defined there resolve. A worker needs none of that (its target lives in
genie), and importing an embedding program's script, the ``genie`` CLI or pytest in every
session would cost time and run that script's top level. :class:`WorkerProcess` sends the
same preparation data as multiprocessing does, less the main module (the launch is
multiprocessing's own ``popen_forkserver.Popen._launch`` otherwise).

The zygote imports :data:`PRELOAD` before its first fork: torch, the worker's code, and the pre-flight's
first-use imports (:mod:`~genie.server.isolation.warm`), 2 to 5 s of a core on a small VM. :func:`start` starts
it; ``genie serve``, ``genie worker`` and ``python -m genie.server`` call it first thing. The node's own process
imports torch only where its devices are ``auto`` or ``cuda`` (to ask CUDA: genie.server.host), then beside the
zygote's import. This module imports no torch; :func:`run_worker` is a worker's target.
"""

from __future__ import annotations

import io
import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing import context, forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

#: Modules the zygote imports once, so a worker starts with them loaded (its pages shared with the zygote's).
PRELOAD = ("torch", "genie.server.isolation.worker", "genie.server.isolation.warm")

#: OpenMP settings the zygote (so every worker) starts with unless the operator set them.
WORKER_OMP = {"OMP_WAIT_POLICY": "PASSIVE"}


def worker_environment(environ: Any) -> None:
    """Set :data:`WORKER_OMP` in ``environ`` (the node's, which the zygote inherits) where unset.

    torch's OpenMP threads otherwise spin for a while after every parallel region. A worker runs
    one small op after another, so its pool spun almost all the time, taking the cores the client
    and the other sessions need: on 2 cores a 2-layer transformer step took 200 ms remote against
    43 ms passive, and the overlap of adaptive batches made it worse (docs/benchmarks.md). libgomp
    reads this when it loads, so it must be in the environment before the zygote imports torch.
    """
    for key, value in WORKER_OMP.items():
        environ.setdefault(key, value)


def start(modules: Sequence[str] = ()) -> None:
    """Start this process's zygote now, importing :data:`PRELOAD` and ``modules``, unless it runs already (then
    nothing changes: a zygote's imports are fixed when it starts). Returns at once: the zygote imports in the
    background and a fork waits for it."""
    worker_environment(os.environ)
    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *modules])
    forkserver.ensure_running()

#: Preparation keys that make a child import the parent's ``__main__``.
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        for key in _MAIN_KEYS:
            prep_data.pop(key, None)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        _parent_w = os.dup(w)  # as multiprocessing: the child's sentinel of its parent
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class WorkerProcess(context.ForkServerProcess):
    """A forkserver process that does not import the parent's ``__main__``."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


def run_worker(conn: Any, clock: Any) -> None:
    """A session worker's target: :func:`genie.server.isolation.worker.worker_main`, imported here, in the worker
    (the zygote loaded it already), so the node's own process never imports the worker's torch."""
    from genie.server.isolation.worker import worker_main

    worker_main(conn, clock)
