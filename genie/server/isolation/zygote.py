"""Worker processes from multiprocessing's forkserver, without re-running the node's ``__main__``.

A forkserver child normally imports the parent's main module again (as ``__mp_main__``) so
pickled functions defined there resolve. A worker needs none of that (its target lives in
genie), and importing an embedding program's script, the ``genie`` CLI or pytest in every
session would cost time and run that script's top level. :class:`WorkerProcess` sends the
same preparation data as multiprocessing does, less the main module (the launch is
multiprocessing's own ``popen_forkserver.Popen._launch`` otherwise).
"""

from __future__ import annotations

import io
import os
from multiprocessing import context, forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

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

