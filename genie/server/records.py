"""Deferred-error records: what a failed command leaves for the next reply (shared by the executor and transfers).

A record is a map ``{"op", "shapes", "kind", "message", "storages"}`` (genie.wire.messages);
``kind`` is ``execution``, ``mismatch``, ``forbidden``, ``quota``, ``storage`` or ``protocol``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genie.errors import ForbiddenOpError, GenieError, ProtocolError, QuotaExceededError, RemoteExecutionError
from genie.server.ops import scrub
from genie.server.store import StorageError

#: Longest record message sent (characters). Some of torch's messages print a whole tensor: meshgrid's for
#: a 2-d input of 2**20 rows was 9.4 MB, a reply the client refuses (found by tests/security/fuzz_ops.py).
MAX_MESSAGE_CHARS = 4000


def error(op: str, shapes: list[Any], kind: str, message: str, storages: Sequence[int] = ()) -> dict[str, Any]:
    """A deferred-error record; its message scrubbed of heap addresses (:func:`genie.server.ops.scrub`) and
    cut to :data:`MAX_MESSAGE_CHARS`."""
    message = scrub(message)  # first: a cut must not leave part of an address behind
    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]} ... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
    return {"op": op, "shapes": shapes, "kind": kind, "message": message, "storages": list(storages)}


def kind_of(exc: BaseException) -> str:
    """The record ``kind`` of an exception."""
    if isinstance(exc, ForbiddenOpError):
        return "forbidden"
    if isinstance(exc, QuotaExceededError):
        return "quota"
    if isinstance(exc, StorageError):
        return "storage"
    if isinstance(exc, RemoteExecutionError):
        return "execution"
    if isinstance(exc, ProtocolError):
        return "protocol"
    return "execution"


def message(exc: BaseException) -> str:
    """The record ``message`` of an exception (its type named unless it is genie's or torch's RuntimeError)."""
    if isinstance(exc, GenieError):
        return str(exc)
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, RuntimeError) else text


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts, in order (aten values nest nothing else)."""
    out: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return out


def shapes(value: Any) -> list[Any]:
    """The shapes of the tensors in ``value`` (a record's ``shapes``)."""
    return [list(v.shape) for v in tensor_leaves(value)]
