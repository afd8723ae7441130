"""The session's command table: every command code of a BATCH and its handler, declared in one place.

A handler is called as ``handler(executor, cmd, keyed)`` with the decoded command (a list whose first
item is the code) and, for OP and CALL, the key the command plans computed (:mod:`genie.server.plans`;
None otherwise). It runs on the session's thread in the order the client sent the commands. A command
that breaks the wire rules raises :class:`~genie.errors.FrameError` (the session closes the connection);
one that is well formed but fails becomes a deferred error or the answer to its request.

To add a command: its code in :mod:`genie.wire.messages` (and docs/protocol.md), its handler in the module
that owns its work (taking the executor's public interface), and one line in :data:`COMMANDS`. A handler
written as ``handler(executor, cmd)`` is listed through :func:`plain`.

Plan tiers (the native runner, the Python plans) run repeated OP and CALL commands before they reach
this table: see :meth:`genie.server.executor.Executor.run_batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from genie.errors import FrameError
from genie.server import collectives, controls, graphs, peer_copy, transfers
from genie.server.codec import Descriptor, is_int
from genie.wire.messages import (
    CMD_CALL,
    CMD_FETCH,
    CMD_FREE,
    CMD_GRAPH,
    CMD_HAVE,
    CMD_OP,
    CMD_OPTIONS,
    CMD_REPLAY,
    CMD_RESIZE,
    CMD_SEED,
    CMD_SYNC,
)

if TYPE_CHECKING:
    from genie.server.executor import Executor
    from genie.server.plans import Keyed

#: A command's handler: (executor, decoded command, its plan key or None).
Handler = Callable[["Executor", list[Any], "Keyed | None"], None]


def plain(handler: Callable[[Executor, list[Any]], None]) -> Handler:
    """A handler that takes no plan key, as the table calls it."""

    def handle(ex: Executor, cmd: list[Any], keyed: Keyed | None) -> None:
        handler(ex, cmd)

    handle.__doc__ = handler.__doc__
    return handle


def _op_command(ex: Executor, cmd: list[Any], keyed: Keyed | None) -> None:
    """``[CMD_OP, device, op, args, kwargs, outs]``: run an op, keep its outputs (the full path)."""
    ex.run_op_command(cmd, keyed)


def _call_command(ex: Executor, cmd: list[Any], keyed: Keyed | None) -> None:
    """``[CMD_CALL, req, device, op, args, kwargs, out_storage_ids]``: run an op and answer with its result."""
    ex.run_call_command(cmd, keyed)


def _free(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_FREE, [storage_id, ...]]``: release storages (the staging pool may reuse their memory)."""
    if len(cmd) != 2 or not isinstance(cmd[1], list):
        raise FrameError("FREE must be [CMD_FREE, [storage_id, ...]]")
    ex.free(s for s in cmd[1] if is_int(s))


def _fetch(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_FETCH, req, device, tensor]``: answer with the described tensor's bytes."""
    if len(cmd) != 4:
        raise FrameError("FETCH must be [CMD_FETCH, req, device, tensor]")
    desc = cmd[3] if isinstance(cmd[3], Descriptor) else Descriptor.parse(cmd[3], "fetched tensor")
    transfers.fetch(ex, cmd[1], cmd[2], desc)


def _sync(ex: Executor, cmd: list[Any]) -> None:
    """``[CMD_SYNC, req]``: answer once everything before it ran."""
    if len(cmd) != 2:
        raise FrameError("SYNC must be [CMD_SYNC, req]")
    controls.sync(ex, cmd[1])


#: Every command code and its handler.
COMMANDS: dict[int, Handler] = {
    CMD_OP: _op_command,
    CMD_CALL: _call_command,
    CMD_FREE: plain(_free),
    CMD_FETCH: plain(_fetch),
    CMD_SYNC: plain(_sync),
    CMD_SEED: plain(controls.seed),
    CMD_RESIZE: plain(controls.resize),
    CMD_HAVE: plain(transfers.have),
    CMD_OPTIONS: plain(controls.options),
    CMD_GRAPH: plain(graphs.define),
    CMD_REPLAY: plain(graphs.replay),
    # torch.distributed between session workers: CMD_DIST_HOST/JOIN/WAIT/LEAVE, CMD_COLLECTIVE
    **{code: plain(handler) for code, handler in collectives.HANDLERS.items()},
    # copies between remote devices (genie.server.peer_copy): CMD_DEVICE_COPY, CMD_PEER_OPEN/RECV/SEND
    **{code: plain(handler) for code, handler in peer_copy.HANDLERS.items()},
}
