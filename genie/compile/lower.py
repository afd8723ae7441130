"""Lowering an AOTAutograd graph (aten ops in an FX graph) to the wire's graph schema.

Slots, in order (see :mod:`genie.wire.graph`): the graph's placeholders, then its constants
(``get_attr`` values, sent as inputs on every run), then the *client scalars*, then one slot per
op node. Client scalars are the graph's non-tensor nodes (``sym_size``, ``operator.mul`` on
sizes ...): they depend only on shapes, so the client computes them in its meta run (cached per
input signature) and sends their values as inputs; the server never evaluates anything but aten
ops. ``getitem`` on a multi-output op becomes a reference ``Ref(slot, item)``.

Anything else (higher-order ops, ops outside aten/prims, a CPU device argument, a tensor
constant too large to send inline) raises :class:`Unsupported`; the backend then runs that graph
op by op and logs why.
"""

from __future__ import annotations

import operator
from typing import Any

import attrs
import torch
from torch import fx

from genie.wire.graph import KERNELS, Ref
from genie.wire.values import MAX_INLINE_TENSOR_BYTES

BACKEND = "remote_accelerator"


class Unsupported(Exception):
    """A graph the server cannot replay; the reason says why (it then runs op by op)."""


@attrs.frozen
class Lowered:
    """A graph ready to be defined on a server."""

    #: number of placeholders, constants and client scalars (the run's inputs, in that order)
    placeholders: int
    constants: list[Any]
    scalar_nodes: list[fx.Node]
    #: ``[op name, args, kwargs]`` per op node (devices still as ``torch.device``)
    nodes: list[list[Any]]
    outputs: list[Ref | None]
    #: whether the output node returns a tuple (else a list)
    returns_tuple: bool
    #: whether a node draws random numbers (the server's generator must be seeded first)
    random: bool
    #: placeholders a node writes to (in place, out=, copy_): a call with a CPU tensor there runs op by op,
    #: since the server would only write its own copy of the CPU tensor
    mutated: frozenset[int] = frozenset()

    @property
    def inputs(self) -> int:
        return self.placeholders + len(self.constants) + len(self.scalar_nodes)


def _is_tensor_value(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_tensor_value(v) for v in value)
    return False


def _is_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims")


_KERNELS: dict[str, str] = {}


def device_kernel(op: torch._ops.OpOverload) -> str:
    """The composite kernel ``op`` runs on ``remote_accelerator`` ("" when the device's own path runs it).

    An op with no kernel of the device's own runs its CompositeExplicitAutograd kernel on the
    client, which sends the inner ops one by one; a replay asks the server for the same kernel so
    both compute the same bits (``native_layer_norm``'s composite differs from the CPU kernel).
    """
    name = op.name()
    found = _KERNELS.get(name)
    if found is None:
        found = ""
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"):
            for key in KERNELS:
                if torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
                    found = key
                    break
        _KERNELS[name] = found
    return found


def lower(gm: fx.GraphModule) -> Lowered:
    """Lower ``gm``; :class:`Unsupported` when a node cannot be replayed on the server."""
    from genie.device.dispatch import op_info

    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    constants: list[Any] = []
    constant_nodes: list[fx.Node] = []
    scalar_nodes: list[fx.Node] = []
    op_nodes: list[fx.Node] = []
    items: dict[fx.Node, tuple[fx.Node, int]] = {}
    output: fx.Node | None = None
    for n in nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":
            value = getattr(gm, str(n.target))  # our own graph module's attribute, named by the tracer
            if not isinstance(value, torch.Tensor):
                raise Unsupported(f"constant {n.target} is a {type(value).__name__}, not a tensor")
            if value.get_device() < 0 and value.nbytes > MAX_INLINE_TENSOR_BYTES:
                raise Unsupported(f"CPU constant {n.target} of {value.nbytes} bytes is too large to send inline")
            constants.append(value)
            constant_nodes.append(n)
        elif n.op == "call_function":
            value = n.meta.get("val")
            if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].op == "call_function" \
                    and _is_op(n.args[0].target) and isinstance(n.args[1], int):
                items[n] = (n.args[0], n.args[1])
            elif _is_op(n.target) and _is_tensor_value(value):
                op_nodes.append(n)
            elif not isinstance(value, (torch.Tensor, list, tuple)) and value is not None:
                scalar_nodes.append(n)  # a number computed from sizes: the client's meta run gives it
            else:
                raise Unsupported(f"node {n.name} calls {getattr(n.target, '__name__', n.target)!s:.80}, which "
                                  "genie servers do not replay")
        elif n.op == "output":
            output = n
        else:
            raise Unsupported(f"node {n.name} is a {n.op} node")
    if output is None:
        raise Unsupported("the graph has no output node")

    slots: dict[fx.Node, int] = {}
    for i, n in enumerate([*placeholders, *constant_nodes, *scalar_nodes]):
        slots[n] = i
    first_node_slot = len(slots)
    for i, n in enumerate(op_nodes):
        slots[n] = first_node_slot + i

    def ref(n: fx.Node) -> Ref:
        if n in items:
            src, item = items[n]
            return Ref(slots[src], item)
        return Ref(slots[n])

    def arg(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return ref(value)
        if isinstance(value, (list, tuple)):
            return [arg(v) for v in value]
        if isinstance(value, torch.device):
            if value.type != BACKEND:
                raise Unsupported(f"an argument names device {value}; a replayed graph stays on its device")
            return value
        if value is None or isinstance(value, (bool, int, float, str, complex, torch.dtype, torch.layout,
                                               torch.memory_format)):
            return value
        raise Unsupported(f"an argument of type {type(value).__name__} cannot be sent in a graph")

    lowered_nodes: list[list[Any]] = []
    random = False
    placeholder_slots = {p: i for i, p in enumerate(placeholders)}
    mutated: set[int] = set()
    for n in op_nodes:
        target = n.target
        assert isinstance(target, torch._ops.OpOverload)
        random = random or op_info(target).random
        for i, a in enumerate(target._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                for v in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(v, fx.Node) and v in placeholder_slots:
                        mutated.add(placeholder_slots[v])
        node = [target.name(), arg(list(n.args)), {k: arg(v) for k, v in n.kwargs.items()}]
        kernel = device_kernel(target)
        if kernel:
            node.append(kernel)
        lowered_nodes.append(node)
    results = output.args[0]
    if not isinstance(results, (list, tuple)):
        raise Unsupported("the graph's output is not a list or tuple")
    outputs: list[Ref | None] = []
    for r in results:
        if r is None or (isinstance(r, fx.Node) and r in scalar_nodes):
            outputs.append(None)  # numbers come from the meta run; None stays None
        elif isinstance(r, fx.Node):
            outputs.append(ref(r))
        else:
            raise Unsupported(f"the graph returns a constant {type(r).__name__}")
    return Lowered(len(placeholders), constants, scalar_nodes, lowered_nodes, outputs,
                   isinstance(results, tuple), random, frozenset(mutated))
