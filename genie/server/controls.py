"""The session's control commands: SYNC, SEED, RESIZE and OPTIONS (see :mod:`genie.wire.messages`).

They run on the session's thread through the executor's public interface, in the order the
client sent them; the op path (ops, calls, fetches, frees) stays in :mod:`genie.server.executor`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from genie.errors import FrameError, GenieError
from genie.server.codec import MAX_NBYTES, check_id, is_int
from genie.server.records import error as _error
from genie.server.records import kind_of as _kind_of
from genie.server.records import message as _message
from genie.server.store import zero_from
from genie.wire.messages import SESSION_OPTIONS

if TYPE_CHECKING:
    from genie.server.executor import Executor

#: Seeds accepted by CMD_SEED (torch.Generator.manual_seed's range).
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def sync(ex: Executor, req: Any) -> None:
    """``[CMD_SYNC, req]``: reply once everything before it has run (CUDA devices synchronised)."""
    error = None
    for device in {d for d in ex.devices if d.type == "cuda"}:
        try:
            torch.cuda.synchronize(device)
        except Exception as exc:  # an asynchronous kernel failure surfaces here
            error = _error("sync", [], "execution", f"{device}: {_message(exc)}")
    ex.reply(req, error, None)


def seed(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_SEED, device, generator_id, seed]``: (re)seed one of the session's generators."""
    if len(cmd) != 4 or not is_int(cmd[2]) or not 0 <= cmd[2] < (1 << 63) or not is_int(cmd[3]) \
            or not SEED_RANGE[0] <= cmd[3] <= SEED_RANGE[1]:
        raise FrameError("SEED must be [CMD_SEED, device, generator_id >= 0, seed (a 64-bit integer)]")
    try:
        ex.begin(cmd[1])
        ex.generators.seed(cmd[1], cmd[2], cmd[3])
    except GenieError as exc:
        ex.defer(_error("seed", [], _kind_of(exc), str(exc)))


def resize(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_RESIZE, device, storage_id, new_nbytes]``: grow or shrink a storage in place (grown bytes zero)."""
    if len(cmd) != 4:
        raise FrameError("RESIZE must be [CMD_RESIZE, device, storage_id, new_nbytes]")
    storage_id = check_id(cmd[2], "resized storage id")
    new = cmd[3]
    if storage_id == 0 or not is_int(new) or not 0 <= new <= MAX_NBYTES:
        raise FrameError(f"RESIZE needs a storage id above 0 and a byte count, got {cmd[2]!r}, {new!r}")
    try:
        device = ex.begin(cmd[1])
        storage = ex.store.get(storage_id)
        if storage is None:
            ex.store.make(storage_id, new, device)
            return
        old = storage.nbytes()
        ex.store.check_room(0, new - old)
        storage.resize_(new)
        if new > old:
            zero_from(storage, old)
        ex.store.resized(storage_id)
    except Exception as exc:
        ex.store.poison(storage_id, f"resize: {_message(exc)}")
        ex.defer(_error("resize", [[new]], _kind_of(exc), _message(exc), [storage_id]))


def options(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_OPTIONS, {"deterministic": bool, "warn_only": bool}]``: the client's
    ``torch.use_deterministic_algorithms`` for the session's later commands.

    torch keeps the setting per process: a session worker (the default isolation) has it to itself; with
    ``--isolation none`` the node's sessions share it (docs/device.md). Only these two booleans are read.
    """
    if len(cmd) != 2 or not isinstance(cmd[1], dict) or set(cmd[1]) - set(SESSION_OPTIONS) \
            or not all(type(v) is bool for v in cmd[1].values()):
        raise FrameError(f"OPTIONS must be [CMD_OPTIONS, a map of {', '.join(SESSION_OPTIONS)} to booleans]")
    deterministic = cmd[1].get("deterministic", False)
    # torch.use_deterministic_algorithms() would also import torch._inductor to set its config (nothing here
    # compiles with inductor): an import of a few hundred ms, which deadlocked against the worker's warm-up
    # thread importing torch._dynamo at the same time.
    torch._C._set_deterministic_algorithms(deterministic, warn_only=deterministic and cmd[1].get("warn_only", False))

