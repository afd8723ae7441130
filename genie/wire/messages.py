"""Message bodies of the data plane.

A BATCH frame's body is a msgpack map::

    {"uploads": [[handle, device, dtype code, shape, nbytes], ...],   # payload, in this order
     "cmds":    [<msgpack bytes of one command>, ...]}

Uploads are registered before the commands run. Each command is decoded just
before it runs, so handles made earlier in the same batch resolve. Commands
are msgpack arrays whose first element is a CMD_* code:

- ``[CMD_OP, op, args, kwargs, outs]`` runs an aten op fire-and-forget; ``outs``
  lists, for each tensor the op returns (flattened in order), the
  ``[handle, dtype code, shape, stride, storage offset]`` the client already
  computed with meta tensors. The server checks the real outputs against it.
- ``[CMD_FREE, [handle, ...]]`` releases handles.
- ``[CMD_FETCH, req, handle]`` replies with the tensor's bytes (contiguous).
- ``[CMD_CALL, req, op, args, kwargs, out_handles]`` runs an op and replies with
  its result: tensors are stored under ``out_handles`` and described as
  ``[handle, dtype code, shape, stride, storage offset]``; other values as they are.
  Used for data-dependent shapes and ops that return numbers.
- ``[CMD_SYNC, req]`` replies once everything before it has run.

Every request (FETCH, CALL, SYNC) gets one REPLY frame, in order; its body is
``[req, error or None, result, deferred]`` where ``deferred`` lists the errors
of fire-and-forget ops since the last reply (each a map with ``op``,
``shapes``, ``kind`` and ``message``). A FETCH reply carries the tensor's
bytes as its payload.

Details the server (genie.server) fixes, all compatible with the above:

- ``error`` is None or a map of the same shape as a deferred entry. Entries may
  also carry ``handles``: the output handles the failed command poisoned.
  ``kind`` is ``execution``, ``mismatch`` (the server's output disagrees with the
  client's ``outs``), ``forbidden``, ``quota``, ``handle`` (unknown handle) or
  ``protocol``. Deferred entries past 256 are summarised in one last entry.
- A FETCH result is ``[dtype code, shape]`` of the (contiguous) payload.
- An upload's device is a plain int index (the device tag is accepted too).
- Op names are ``OpOverload.name()``: ``"aten::add.Tensor"``, ``"aten::mm"``
  (``"aten::mm.default"`` is accepted too); only aten/prims, never a deny-listed op.
- HELLO carries ``"auth": {"alg", "client_nonce"}``; a cluster token is proved
  by the HMAC challenge of :mod:`genie.wire.handshake`, never sent. WELCOME is
  ``{"node_id", "genie", "protocol", "torch", "devices": [{"index", "kind",
  "name", "memory_total"}], "limits": {"max_session_handles",
  "max_session_bytes", "max_frame_bytes", "max_body_bytes",
  "max_inline_tensor_bytes"}}``; REJECT is ``{"code", "reason"}`` with code
  ``protocol``, ``torch_version``, ``auth``, ``tls`` or ``frame``.
- A frame that breaks the wire rules inside a session is answered, if the
  connection still works, with an ERROR frame ``{"code": "frame", "reason"}``
  (``"internal"`` for a server bug), then the connection is closed.
"""

from __future__ import annotations

from typing import Any

import torch

from genie._version import __version__
from genie.wire.frame import PROTOCOL_VERSION

CMD_OP = 1
CMD_FREE = 3
CMD_FETCH = 4
CMD_CALL = 5
CMD_SYNC = 6


def hello_body(*, node_id: str, role: str, backends: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The first message a connecting peer sends."""
    body = {
        "genie": __version__,
        "protocol": PROTOCOL_VERSION,
        "torch": torch.__version__,
        "node_id": node_id,
        "role": role,
        "backends": backends,
    }
    body.update(extra or {})
    return body


def torch_compatible(mine: str, theirs: str) -> bool:
    """Peers must run the same torch major.minor: op schemas differ between releases."""
    return mine.split(".")[:2] == str(theirs).split(".")[:2]
