"""Graphs on the wire: a captured aten graph sent once, then replayed with one command per call.

A graph is defined once per session and device (``CMD_GRAPH``, a round trip) and then run by
``CMD_REPLAY`` commands that carry only the inputs and the client's output descriptors
(fire-and-forget, like ``CMD_OP``). Both command codes live in :mod:`genie.wire.messages`'
table; this module fixes the graph's own schema and its encoding.

The definition is plain data, never code and never pickle::

    {"inputs": n,                                   # slots 0 .. n-1 are the run's inputs
     "nodes": [[op, args, kwargs(, kernel)], ...],  # node i fills slot n + i
     "outputs": [ref or None, ...]}

``op`` is an op name as ``CMD_OP`` takes it (``"aten::mm"``): the server resolves and checks
it exactly like a single op's. ``args``/``kwargs`` hold the same tagged values as an op's
arguments (:mod:`genie.wire.values`: dtypes, devices, layouts, numbers, lists ...) plus
*references*: the ext tag :data:`EXT_REF` with data ``msgpack [slot, item]``, the value in an
earlier slot (``item`` -1), or item ``item`` of the list or tuple a multi-output op left there.
A definition carries no tensor descriptors: every tensor comes from an input or a node.
``kernel``, when present, is one of :data:`KERNELS`: run the op's composite kernel of that
name rather than the server device's own, as the client's device would run it op by op (its
device has no kernel of its own for that op, so ``CMD_OP`` would carry the composite's inner
ops): a replay then computes bit for bit what op-by-op execution computes.

The definition travels as one msgpack ``bin`` inside the command, decoded by
:func:`decode_definition` (bounded: at most :data:`MAX_NODES` nodes, :data:`MAX_INPUTS` inputs).

Commands (``device`` a device index on the receiving node, ``graph_id`` chosen by the client,
a positive 63-bit integer never reused within a session)::

    [CMD_GRAPH, req, device, graph_id, definition]   -> REPLY, result None; the error names the
                                                         first node the server refuses
    [CMD_REPLAY, device, graph_id, inputs, outs]      fire-and-forget

``inputs`` are tensor descriptors (tag 8), small inline CPU tensors (tag 7) or plain numbers,
one per input slot. ``outs`` has one entry per graph output: a descriptor for a tensor output
(the output rule of ``CMD_OP`` applies to each), None for a number or an undefined tensor.
"""

from __future__ import annotations

from typing import Any

import attrs
import msgpack

from genie.errors import FrameError
from genie.wire.frame import unpack_body
from genie.wire.values import encode_common, make_ext_hook

#: Ext tag of a reference to an earlier slot (outside the 1-9 range of genie.wire.values' op arguments).
EXT_REF = 32
#: Composite kernels a node may ask for (by these exact names).
KERNELS = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
#: Most nodes and inputs one graph may have.
MAX_NODES = 1 << 16
MAX_INPUTS = 1 << 14
#: Largest msgpack body of one definition.
MAX_DEFINITION_BYTES = 8 << 20


@attrs.frozen
class Ref:
    """The value in slot ``slot`` (``item`` -1), or item ``item`` of the sequence there."""

    slot: int
    item: int = -1


@attrs.frozen
class Definition:
    """A decoded graph definition (structure checked; ops and references not yet validated)."""

    inputs: int
    nodes: list[list[Any]]
    outputs: list[Any]


def pack_ref(ref: Ref) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_REF, msgpack.packb([ref.slot, ref.item]))


def encode_definition(inputs: int, nodes: list[list[Any]], outputs: list[Any], default: Any) -> bytes:
    """The msgpack of a definition; ``default`` encodes devices (the session's own indices) and the like."""

    def enc(obj: Any) -> Any:
        if isinstance(obj, Ref):
            return pack_ref(obj)
        encoded = encode_common(obj)
        if encoded is not NotImplemented:
            return encoded
        return default(obj)

    return msgpack.packb({"inputs": inputs, "nodes": nodes, "outputs": outputs}, use_bin_type=True, default=enc)


def _ref(data: bytes) -> Ref:
    try:
        value = msgpack.unpackb(data)
    except Exception:
        value = None
    if (type(value) is not list or len(value) != 2 or type(value[0]) is not int or type(value[1]) is not int
            or value[0] < 0 or value[1] < -1):
        raise FrameError(f"a graph reference must be [slot >= 0, item >= -1], got {value!r:.60}")
    return Ref(value[0], value[1])


def _no_tensor(_: Any) -> Any:
    raise FrameError("a graph definition carries no tensor descriptors; tensors are inputs or node results")


def decode_definition(data: Any, resolve_device: Any, resolve_generator: Any) -> Definition:
    """Decode and structure-check a definition; FrameError when malformed."""
    if not isinstance(data, bytes) or len(data) > MAX_DEFINITION_BYTES:
        raise FrameError(f"a graph definition must be msgpack bytes of at most {MAX_DEFINITION_BYTES} bytes")
    standard = make_ext_hook(_no_tensor, resolve_device, resolve_generator)

    def hook(code: int, payload: bytes) -> Any:
        return _ref(payload) if code == EXT_REF else standard(code, payload)

    body = unpack_body(data, ext_hook=hook)
    if not isinstance(body, dict) or set(body) != {"inputs", "nodes", "outputs"}:
        raise FrameError("a graph definition must be a map with exactly 'inputs', 'nodes' and 'outputs'")
    inputs, nodes, outputs = body["inputs"], body["nodes"], body["outputs"]
    if type(inputs) is not int or not 0 <= inputs <= MAX_INPUTS:
        raise FrameError(f"a graph has 0 to {MAX_INPUTS} inputs, got {inputs!r:.40}")
    if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
        raise FrameError(f"a graph's nodes must be a list of at most {MAX_NODES}")
    for i, node in enumerate(nodes):
        if (not isinstance(node, list) or len(node) not in (3, 4) or not isinstance(node[1], list)
                or not isinstance(node[2], dict) or not all(isinstance(k, str) for k in node[2])
                or len(node) == 4 and node[3] not in KERNELS):
            raise FrameError(f"graph node {i} must be [op, args (a list), kwargs (a map with string keys)] and "
                             f"optionally a kernel, one of {', '.join(KERNELS)}")
    if not isinstance(outputs, list) or not all(o is None or isinstance(o, Ref) for o in outputs):
        raise FrameError("a graph's outputs must be a list of references (or None)")
    return Definition(inputs, nodes, outputs)
