"""Message bodies of the data plane (protocol 2: storages and tensor descriptors).

The server keeps, per session, *storages* named by client-chosen ids (63-bit,
never reused, 0 = an empty storage) and builds tensors over them from
*descriptors*: ``[storage_id, dtype code, sizes, strides, storage_offset,
storage_nbytes]`` (offset in elements, ``storage_nbytes`` the storage's size as
the client knows it). As an argument a descriptor is the EXT_TENSOR tag of
:mod:`genie.wire.values`; in ``outs`` and replies it is a plain list.

A BATCH frame's body is a msgpack map::

    {"uploads": [[storage_id, device, nbytes], ...],   # the payload, in this order
     "cmds":    [<msgpack bytes of one command>, ...]}

An upload creates storage ``storage_id`` on ``device`` holding exactly those
bytes, or overwrites every byte of an existing storage of that size. Uploads
are applied before the commands. Each command is decoded just before it runs.
Commands are msgpack arrays whose first element is a CMD_* code; ``device`` is
a device index on the receiving node:

- ``[CMD_OP, device, op, args, kwargs, outs]`` runs an aten op fire-and-forget.
  ``outs`` holds one descriptor per tensor the op returns (flattened in schema
  order; None for an undefined output). Per output: a storage the session knows
  (in-place, ``out=``, views) must end up holding the result in the described
  tensor (nothing to do if the result already is it, else ``copy_``); an unknown
  storage adopts the result's storage when it has exactly ``storage_nbytes``
  bytes and the described layout, else a zeroed storage of ``storage_nbytes`` is
  made and the result copied in. A dtype or size disagreement is a ``mismatch``.
- ``[CMD_FREE, [storage_id, ...]]`` drops storages (unknown ids are ignored).
- ``[CMD_FETCH, req, device, tensor]`` replies with the described tensor's bytes,
  contiguous; the result is ``[dtype code, sizes]``.
- ``[CMD_CALL, req, device, op, args, kwargs, out_storage_ids]`` runs an op and
  replies with its result: tensors are stored under ``out_storage_ids`` (one per
  returned tensor, in order) and described as descriptors; other values as they
  are. Used for data-dependent shapes and ops that return numbers.
- ``[CMD_SYNC, req]`` replies once everything before it has run.
- ``[CMD_SEED, device, generator_id, seed]`` (re)seeds a session generator
  (0: the device's default). Until then each is seeded from ``os.urandom``.
- ``[CMD_RESIZE, device, storage_id, new_nbytes]`` grows or shrinks a storage
  in place, keeping its prefix; grown bytes are zero.
- ``[CMD_GRAPH, req, device, graph_id, definition]`` defines a captured aten graph
  (torch.compile's ``backend="genie"``), validated op by op like single ops; and
  ``[CMD_REPLAY, device, graph_id, inputs, outs]`` runs it fire-and-forget. Their
  schema is :mod:`genie.wire.graph`.
- ``[CMD_OPTIONS, {"deterministic": bool, "warn_only": bool}]`` sets the torch
  settings the session's later commands run under (``torch.use_deterministic_algorithms``
  on the client); the client sends it before the first command after a change.
- ``CMD_DIST_HOST``, ``CMD_DIST_JOIN``, ``CMD_COLLECTIVE``, ``CMD_DIST_WAIT`` and ``CMD_DIST_LEAVE``:
  torch.distributed collectives run between session workers (:mod:`genie.server.collectives`).
- ``CMD_DEVICE_COPY``, ``CMD_PEER_OPEN``, ``CMD_PEER_RECV`` and ``CMD_PEER_SEND``: copies between
  two devices of one node, or node to node (:mod:`genie.server.peer_copy`).

A storage the session has not seen yet, named by an argument, a FETCH or a
RESIZE, is made on the command's device, zero-filled (the client's allocator
hands out ids without a round trip). Every fresh storage a session gets is
zeroed unless the session wrote all of it (an upload, an op's fresh result).

Every request (FETCH, CALL, SYNC) gets one REPLY frame, in order; its body is
``[req, error or None, result, deferred]`` where ``deferred`` lists the errors
of fire-and-forget commands since the last reply. A FETCH reply carries the
tensor's bytes as its payload.

Details the server (genie.server) fixes, all compatible with the above:

- ``error`` is None or a map of the same shape as a deferred entry: ``op``,
  ``shapes``, ``kind``, ``message`` and ``storages`` (the output storage ids the
  failed command poisoned: later uses name the root cause). ``kind`` is
  ``execution``, ``mismatch`` (the server's output disagrees with the client's
  ``outs``), ``forbidden``, ``quota``, ``storage`` (a storage freed, poisoned or
  of another size than the descriptor says) or ``protocol`` (a descriptor out of
  its storage's bounds, a device the node lacks). Deferred entries past 256 are
  summarised in one last entry.
- A descriptor is checked before use: at most 64 dims, sizes, strides and offset
  non-negative, dtype known, the whole span inside ``storage_nbytes``, which must
  equal the server's size of a known storage.
- Random ops whose ``generator`` is None use the session's default generator of
  the device, so sessions never share a random stream.
- Op names are ``OpOverload.name()``: ``"aten::add.Tensor"``, ``"aten::mm"``
  (``"aten::mm.default"`` is accepted too); only aten/prims, never a deny-listed
  op. An op with no kernel for the server's device runs its registered
  decomposition.
- HELLO carries ``"auth": {"alg", "client_nonce"}``; a cluster token is proved
  by the HMAC challenge of :mod:`genie.wire.handshake`, never sent. WELCOME is
  ``{"node_id", "genie", "protocol", "torch", "devices": [{"index", "kind",
  "name", "memory_total"}], "limits": {"max_session_handles" (storages per
  session), "max_session_bytes", "max_frame_bytes", "max_body_bytes",
  "max_inline_tensor_bytes", ...}}``; REJECT is ``{"code", "reason"}`` with code
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
CMD_SEED = 7
CMD_RESIZE = 8
CMD_HAVE = 9
CMD_GRAPH = 10
CMD_REPLAY = 11
CMD_OPTIONS = 12
# torch.distributed on remote devices (genie.server.collectives; schema in docs/protocol.md): 40 and up, apart
# from the op stream's own codes.
CMD_DIST_HOST = 40
CMD_DIST_JOIN = 41
CMD_COLLECTIVE = 42
CMD_DIST_WAIT = 43
CMD_DIST_LEAVE = 44
# Copies between remote devices (genie.server.peer_copy; schema in docs/protocol.md).
CMD_DEVICE_COPY = 50
CMD_PEER_OPEN = 51
CMD_PEER_RECV = 52
CMD_PEER_SEND = 53

#: The keys of CMD_OPTIONS' map; each value is a bool.
SESSION_OPTIONS = ("deterministic", "warn_only")


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
