"""Reinplacing functional ``_foreach_*`` ops whose results only go back into mutated inputs.

AOTAutograd functionalises a compiled optimizer step: ``exp_avg.mul_(beta1)`` becomes
``t = _foreach_mul(exp_avg, beta1)`` and, at the end of the graph, ``copy_(exp_avg, t[i])`` per
tensor. Replayed on a server, every such op allocates a fresh list of tensors and the epilogue
copies them back: about 40 % of a replayed AdamW step's op time. torch's own pass
(``torch.fx.passes.reinplace``) leaves foreach ops alone.

:func:`reinplace_foreach` rewrites ``_foreach_X(L, ...)`` as ``_foreach_X_(L, ...)`` when, for every
tensor of ``L``:

- it is a graph input the graph overwrites at its end anyway (an epilogue ``copy_`` into it), so
  writing it earlier changes nothing the caller can see once the graph has run;
- no later node reads its current value (later readers of the *result* read the tensor itself
  after the rewrite, so a chain of foreach ops on one state list stays in place);
- it appears once in ``L``, is not a graph output and has no view taken of it.

Readers of the result's items then read the input; an epilogue ``copy_(x, x)`` left behind is
dropped. The same kernels compute the same values, so results are bit-identical to the
functional graph (tests compare replayed steps with op-by-op ones).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

_aten = torch.ops.aten


def _inplace_of(op: Any) -> torch._ops.OpOverload | None:
    """The in-place overload of a functional ``aten::_foreach_*`` overload, or None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    packet = op.overloadpacket.__name__
    if not packet.startswith("_foreach_") or packet.endswith("_"):
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
        return None
    inplace_packet = getattr(_aten, packet + "_", None)
    if inplace_packet is None or op._overloadname not in inplace_packet.overloads():
        return None
    inplace: torch._ops.OpOverload = getattr(inplace_packet, op._overloadname)
    first = inplace._schema.arguments[0]
    if first.alias_info is None or not first.alias_info.is_write:
        return None
    if [a.name for a in inplace._schema.arguments] != [a.name for a in op._schema.arguments]:
        return None
    return inplace


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None for r in target._schema.returns)


def reinplace_foreach(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see the module docstring); returns how many foreach nodes were rewritten."""
    graph = gm.graph
    nodes = list(graph.nodes)
    output = next((n for n in nodes if n.op == "output"), None)
    returned = set(output.all_input_nodes) if output is not None else set()
    epilogue: dict[fx.Node, fx.Node] = {}  # mutated input -> its copy_ at the end
    for n in nodes:
        if n.op == "call_function" and n.target is _aten.copy_.default and isinstance(n.args[0], fx.Node) \
                and n.args[0].op == "placeholder":
            epilogue[n.args[0]] = n
    order = {m: i for i, m in enumerate(nodes)}
    rewritten = 0
    for n in nodes:
        inplace = _inplace_of(n.target) if n.op == "call_function" else None
        if inplace is None or not n.args or not isinstance(n.args[0], (list, tuple)):
            continue
        targets = list(n.args[0])
        if not targets or len(set(targets)) != len(targets) or not all(isinstance(t, fx.Node) for t in targets):
            continue
        if not all(_writable(t, n, order, epilogue, returned) for t in targets):
            continue
        items = [u for u in n.users if u.target is operator.getitem and isinstance(u.args[1], int)]
        if len(items) != len(n.users):
            continue  # the list itself is used whole: leave it
        with graph.inserting_before(n):
            new = graph.call_function(inplace, tuple(n.args), dict(n.kwargs))
        new.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")})
        new.meta["val"] = None
        order[new] = order[n]
        for item in items:
            item.replace_all_uses_with(targets[item.args[1]])
            graph.erase_node(item)
        graph.erase_node(n)
        rewritten += 1
    for dest, copy in epilogue.items():
        if copy.args[1] is dest:  # copy_(x, x): the value is already there
            copy.replace_all_uses_with(dest)
            graph.erase_node(copy)
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _writable(t: fx.Node, at: fx.Node, order: dict[fx.Node, int], epilogue: dict[fx.Node, fx.Node],
              returned: set[fx.Node]) -> bool:
    """Whether ``at`` may overwrite tensor ``t`` (see the module docstring)."""
    copy = epilogue.get(t)
    if t.op != "placeholder" or copy is None or t in returned:
        return False
    for user in t.users:
        if user is at or (user is copy and copy.args[1] is not t):
            continue  # an epilogue copy from elsewhere only writes it; copy_(t, t) keeps its value: a reader
        if _is_view(user) or order[user] > order[at]:
            return False  # a view could read it later; a later node reads its current value
    return True
