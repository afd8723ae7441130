"""What each collective kind of ``CMD_COLLECTIVE`` does on a gloo group, and the checks of its fields.

:func:`starter` turns a collective's kind, its resolved tensors and its parameters (all from the
network) into the call that starts it on a process group, the tensors it writes and what to do once
it ended; it refuses, with a :class:`~genie.errors.ProtocolError` naming the fix, every field that
breaks the rules in :mod:`genie.server.collectives`' docstring. Kinds and reduce ops are looked up in
fixed tables here, never by getattr.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from genie.errors import ProtocolError
from genie.server.codec import is_int

#: Reduce ops by their wire names.
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}
#: Every kind a CMD_COLLECTIVE may name.
KINDS = ("all_reduce", "broadcast", "all_gather", "all_gather_into", "reduce_scatter", "reduce_scatter_tensor",
         "barrier", "send", "recv", "reduce", "gather", "scatter", "all_to_all_single", "all_to_all")


def _tensors(value: Any, what: str) -> list[torch.Tensor]:
    if not isinstance(value, list) or not all(isinstance(t, torch.Tensor) for t in value):
        raise ProtocolError(f"{what} must be a list of tensors")
    return value


def _reduce_op(params: dict[str, Any]) -> Any:
    op = _OPS.get(params.get("op", "sum"))
    if op is None:
        raise ProtocolError(f"unknown reduce op {params.get('op')!r:.20}; one of {', '.join(_OPS)}")
    return op


def _rank_param(params: dict[str, Any], key: str, world: int) -> int:
    value: Any = params.get(key)
    if not is_int(value) or not 0 <= value < world:
        raise ProtocolError(f"{key} must be a rank from 0 to {world - 1}, got {value!r:.20}")
    return int(value)


Starter = tuple[Callable[[Any], Any], list[Any], Callable[[], None] | None]


def _reduce_scatter(out: torch.Tensor, chunks: list[torch.Tensor], params: dict[str, Any], rank: int) -> Starter:
    """reduce_scatter as an all_reduce of the inputs laid end to end, this rank's part copied out after (gloo's
    own reduce_scatter did not finish between session workers: twice the bytes, but the path all_reduce takes)."""
    flat = torch.cat([c.reshape(-1) for c in chunks])
    opts = dist.AllreduceOptions()
    opts.reduceOp = _reduce_op(params)
    if any(c.numel() != out.numel() for c in chunks):
        raise ProtocolError("reduce_scatter's output must have the size of each input chunk")

    def after() -> None:
        out.copy_(flat.view(len(chunks), -1)[rank].view_as(out))

    return (lambda pg: pg.allreduce([flat], opts)), [out], after


def _alike(tensors: list[torch.Tensor], like: torch.Tensor, what: str) -> None:
    """Each of ``tensors`` has ``like``'s dtype and element count (what gloo's gather and scatter move)."""
    for t in tensors:
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ProtocolError(f"{what} holds a {t.dtype} tensor of {t.numel()} elements; each must have the "
                                f"{like.numel()} {like.dtype} elements of this rank's own tensor")


def _root_list(value: Any, rank: int, root: int, world: int, what: str, like: torch.Tensor) -> list[torch.Tensor]:
    """The root's one tensor per rank (checked against ``like``); an empty list on every other rank."""
    tensors = _tensors(value, what)
    if rank != root:
        if tensors:
            raise ProtocolError(f"{what} is given on the root rank ({root}) only, not on rank {rank}")
        return tensors
    if len(tensors) != world:
        raise ProtocolError(f"{what} holds {len(tensors)} tensors; the root gives one per rank ({world})")
    _alike(tensors, like, what)
    return tensors


def _splits(params: dict[str, Any], key: str, t: torch.Tensor, world: int) -> list[int]:
    """all_to_all_single's split sizes ``params[key]`` for ``t``: [] (equal parts) or one row count per rank."""
    value: Any = params.get(key, [])
    rows = t.shape[0] if t.dim() else 1
    if not isinstance(value, list) or not all(is_int(v) and v >= 0 for v in value):
        raise ProtocolError(f"{key} must be a list of non-negative row counts")
    if not value:
        if rows % world:
            raise ProtocolError(f"{rows} rows do not split into {world} equal parts; give {key}")
        return []
    if len(value) != world or sum(value) != rows:
        raise ProtocolError(f"{key} must be {world} row counts adding up to the tensor's {rows} rows")
    return [int(v) for v in value]


def _all_to_all_single(args: Any, params: dict[str, Any], world: int, rank: int) -> Starter:
    if not isinstance(args, list) or len(args) != 2:
        raise ProtocolError("all_to_all_single takes [output, input]")
    out, inp = _tensors(args, "all_to_all_single's tensors")
    if out.dtype != inp.dtype or out.shape[1:] != inp.shape[1:]:
        raise ProtocolError("all_to_all_single's output and input must have one dtype and the same sizes past "
                            "dimension 0")
    out_splits, in_splits = _splits(params, "out_splits", out, world), _splits(params, "in_splits", inp, world)
    to_self = in_splits[rank] if in_splits else (inp.shape[0] if inp.dim() else 1) // world
    from_self = out_splits[rank] if out_splits else (out.shape[0] if out.dim() else 1) // world
    if to_self != from_self:
        raise ProtocolError(f"rank {rank} sends itself {to_self} rows but expects {from_self} from itself; "
                            f"in_splits[{rank}] and out_splits[{rank}] must be equal")
    opts = dist.AllToAllOptions()
    return (lambda pg: pg.alltoall_base(out, inp, out_splits, in_splits, opts)), [out], None


def _all_to_all(args: Any, world: int) -> Starter:
    if not isinstance(args, list) or len(args) != 2:
        raise ProtocolError("all_to_all takes [outputs, inputs]")
    outs, ins = _tensors(args[0], "all_to_all's outputs"), _tensors(args[1], "all_to_all's inputs")
    if len(outs) != world or len(ins) != world:
        raise ProtocolError(f"all_to_all takes one output and one input per rank ({world} each)")
    if len({t.dtype for t in (*outs, *ins)}) != 1:
        raise ProtocolError("all_to_all's tensors must have one dtype")
    # As one all_to_all_single of the tensors laid end to end: gloo's own alltoall wants every tensor of one
    # size, NCCL's (and torch's API) does not.
    flat_in = torch.cat([t.reshape(-1) for t in ins])
    flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype, device=outs[0].device)
    out_splits, in_splits = [t.numel() for t in outs], [t.numel() for t in ins]
    opts = dist.AllToAllOptions()

    def after() -> None:
        for t, part in zip(outs, flat_out.split(out_splits), strict=True):
            t.copy_(part.view(t.shape))

    return (lambda pg: pg.alltoall_base(flat_out, flat_in, out_splits, in_splits, opts)), outs, after


def _rooted(kind: str, args: Any, params: dict[str, Any], world: int, rank: int) -> Starter:
    """reduce, gather and scatter: collectives with a root rank."""
    root = _rank_param(params, "root", world)
    if kind == "reduce":
        ts, ropts = _tensors(args, "reduce's tensors"), dist.ReduceOptions()
        if len(ts) != 1:
            raise ProtocolError("reduce takes one tensor")
        ropts.reduceOp, ropts.rootRank = _reduce_op(params), root
        # gloo leaves partial results in the other ranks' tensors: they are written everywhere
        return (lambda pg: pg.reduce(ts, ropts)), ts, None
    if not isinstance(args, list) or len(args) != 2:
        raise ProtocolError(f"{kind} takes [output, input]")
    if kind == "gather":
        (inp,) = _tensors([args[1]], "gather's input")
        outs = _root_list(args[0], rank, root, world, "gather's output list", inp)
        gopts = dist.GatherOptions()
        gopts.rootRank = root
        return (lambda pg: pg.gather([outs] if outs else [], [inp], gopts)), outs, None
    (out,) = _tensors([args[0]], "scatter's output")
    ins = _root_list(args[1], rank, root, world, "scatter's input list", out)
    sopts = dist.ScatterOptions()
    sopts.rootRank = root
    return (lambda pg: pg.scatter([out], [ins] if ins else [], sopts)), [out], None


def starter(kind: str, args: Any, params: dict[str, Any], world: int, rank: int) -> Starter:
    """How to start collective ``kind`` on a gloo group, the tensors it writes, and what to do once it ended."""
    if kind == "all_reduce":
        ts, opts = _tensors(args, "all_reduce's tensors"), dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(params)
        return (lambda pg: pg.allreduce(ts, opts)), ts, None
    if kind == "broadcast":
        ts, bopts = _tensors(args, "broadcast's tensors"), dist.BroadcastOptions()
        bopts.rootRank = _rank_param(params, "root", world)
        return (lambda pg: pg.broadcast(ts, bopts)), ts, None
    if kind in ("all_gather", "all_gather_into", "reduce_scatter", "reduce_scatter_tensor"):
        if not isinstance(args, list) or len(args) != 2:
            raise ProtocolError(f"{kind} takes [output, input]")
        out, inp = args
        if kind == "all_gather":
            outs, single = _tensors(out, "all_gather's outputs"), _tensors([inp], "all_gather's input")
            return (lambda pg: pg.allgather([outs], single)), outs, None
        if kind == "reduce_scatter":
            ins, single = _tensors(inp, "reduce_scatter's inputs"), _tensors([out], "reduce_scatter's output")
            if len(ins) != world:
                raise ProtocolError(f"reduce_scatter takes one input per rank ({world})")
            return _reduce_scatter(single[0], ins, params, rank)
        o, i = _tensors([out, inp], f"{kind}'s tensors")
        if kind == "all_gather_into":
            return (lambda pg: pg._allgather_base(o, i)), [o], None
        if i.numel() != o.numel() * world:
            raise ProtocolError(f"reduce_scatter_tensor's input must hold {world} times its output's elements")
        return _reduce_scatter(o, list(i.reshape(-1).chunk(world)), params, rank)
    if kind in ("reduce", "gather", "scatter"):
        return _rooted(kind, args, params, world, rank)
    if kind == "all_to_all_single":
        return _all_to_all_single(args, params, world, rank)
    if kind == "all_to_all":
        return _all_to_all(args, world)
    if kind == "barrier":
        return (lambda pg: pg.barrier()), [], None
    if kind in ("send", "recv"):
        ts, peer = _tensors(args, f"{kind}'s tensors"), _rank_param(params, "peer", world)
        tag = params.get("tag", 0)
        if not is_int(tag) or not 0 <= tag < (1 << 31):
            raise ProtocolError("a tag must be a non-negative 31-bit integer")
        if kind == "send":
            return (lambda pg: pg.send(ts, peer, tag)), [], None
        return (lambda pg: pg.recv(ts, peer, tag)), ts, None
    raise ProtocolError(f"unknown collective {kind!r:.40}; one of {', '.join(KINDS)}")
