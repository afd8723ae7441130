"""The one interface between the server core and its native plan runner (genie._C_plans).

The runner (genie/csrc/server/, bound in genie/csrc/server/runner_binding.cpp) reads nothing of the Python core
by attribute name except what this module lists. It is handed four kinds of object, all made here:

- a :class:`NativeSpec` per plan, made from a :class:`genie.server.plans.CommandPlan` by
  :func:`native_spec`, from which ``genie._C_plans.NativePlan`` is built (read by position);
- a :class:`RunnerBinding` per session (:func:`runner_binding`), which ``Runner.bind`` takes when the
  executor is made and whenever its metrics change: the store's :class:`~genie.server.store.StoreTables`
  and the metrics' :class:`~genie.server.metrics.OkTally` (or None), read by position. Of the tally's
  ``latency`` (a :class:`~genie.server.metrics.Latency`) the runner reads and writes the public ``counts``
  and ``sum``; ``record_op`` it calls;
- a :class:`GraphNodeSpec` per node of a defined graph (:func:`graph_node_spec`), from which
  ``genie._C_plans.GraphProgram`` is built (read by position), and the ``Ref`` class of genie.wire.graph, whose
  ``slot`` and ``item`` it reads;
- per ``Runner.run``/``Runner.serve`` call, plain numbers: the store's :attr:`StorageStore.bytes_used
  <genie.server.store.StorageStore.bytes_used>` before it, ``max_op_elements``, the staging pool's smallest
  size and whether no deferred error waits.

The runner changes the store only through the maps of its StoreTables, by the rules of
:meth:`StorageStore.adopt <genie.server.store.StorageStore.adopt>` and :meth:`StorageStore.free
<genie.server.store.StorageStore.free>`; the bytes it adopted and freed it reports (``Runner.take_grown``),
and the executor counts them with :meth:`StorageStore.count_native
<genie.server.store.StorageStore.count_native>`. The field names of each tuple are exported by the
extension too (``SPEC_FIELDS``, ``LAYOUT_FIELDS``, ``BINDING_FIELDS``, ``TABLES_FIELDS``, ``TALLY_FIELDS``),
and tests/server/test_native_binding.py checks they are these tuples' fields, in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from genie.server.metrics import OkTally
from genie.server.store import StoreTables

if TYPE_CHECKING:
    from genie.server.metrics import SessionMetrics
    from genie.server.plans import CommandPlan
    from genie.server.store import StorageStore


class Layout(NamedTuple):
    """A tensor over one of the command's storages, as the plan was checked with it."""

    slot: int  #: the storage's index in the command's storage ids
    nbytes: int  #: the storage's size in bytes
    offset: int  #: storage offset, in elements
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


class NativeSpec(NamedTuple):
    """Everything a ``genie._C_plans.NativePlan`` is built from (see :class:`genie.server.plans.CommandPlan`
    for what each field means there)."""

    op_name: str  #: the schema name of the op run, ``aten::add``
    overload: str  #: its overload name, ``Tensor`` (empty for the default overload)
    label: str  #: the name the op is counted and timed under
    device: torch.device
    call_outs: int  #: a CALL's plan: how many output storage ids it gives; -1 for an OP's
    writes: bool  #: whether the op writes an input (which it may resize)
    new_bytes: int  #: the bytes its fresh outputs take (the byte quota's check)
    max_op_elements: int  #: the session's bound it was checked under
    args: list[Any]  #: positional argument templates: constants, None where a tensor goes
    kwargs: dict[str, Any]  #: keyword argument templates, likewise
    arg_fill: list[tuple[int, int]]  #: (argument position, input index) of each positional tensor
    kw_fill: list[tuple[str, int]]  #: (keyword, input index) of each keyword tensor
    float_values: tuple[float, ...] | None  #: the floats it was checked with, when they decide metadata
    float_fill: list[tuple[int | str, int]]  #: where each command's floats go (position or keyword, -1)
    inputs: list[Layout]  #: per input tensor
    fresh_slots: list[int]  #: ids an out= op run in its functional form needs to be new storages
    outputs: list[Layout | None]  #: per output position; None: an output the client does not keep
    nested_fill: list[tuple[int, list[Any], list[tuple[int, int]]]]  #: Tensor[] arguments: (position, template, fills)


class GraphNodeSpec(NamedTuple):
    """One node of a defined graph as ``genie._C_plans.GraphProgram`` is built from it (genie.server.graphs' _Node,
    validated when the graph was defined)."""

    op_name: str  #: the schema name of the node's op
    overload: str  #: its overload name (empty for the default overload)
    args: list[Any]  #: positional argument templates: constants, genie.wire.graph.Ref where a value goes
    kwargs: dict[str, Any]  #: keyword argument templates
    refs: tuple[tuple[int, int, int], ...]  #: (position, slot, item) of each top-level reference
    nested: tuple[tuple[int, list[Any]], ...]  #: (position, template) of each list holding references
    kw_refs: tuple[tuple[str, Any], ...]  #: (keyword, template) of each keyword holding references (out=)
    release: tuple[int, ...]  #: slots whose last use is this node
    zero: bool  #: an empty-family op: a fresh result is zeroed
    kernel: str  #: the composite kernel called (a name of genie.wire.graph.KERNELS), or "" for the op's dispatch
    native: bool  #: whether C++ may call the op itself (else the program's Python callable runs the node)


class RunnerBinding(NamedTuple):
    """What one session's runner works on: its store and, when the session's figures are kept, its metrics."""

    tables: StoreTables
    tally: OkTally | None


def native_spec(plan: CommandPlan) -> NativeSpec:
    """The native runner's view of ``plan``."""
    schema = plan.kernel._schema
    inputs = [Layout(slot, nbytes, offset, tuple(sizes), tuple(strides), empty.dtype)
              for slot, nbytes, offset, sizes, strides, empty in plan.inputs]
    outputs = [None if d is None else Layout(slot, d.storage_nbytes, d.offset, tuple(d.sizes), tuple(d.strides),
                                             d.dtype)
               for d, slot in zip(plan.out_descs, plan.out_slots, strict=True)]
    return NativeSpec(schema.name, schema.overload_name, plan.label, plan.device, plan.call_outs, plan.writes,
                      plan.new_bytes, plan.max_op_elements, plan.args, plan.kwargs, plan.arg_fill, plan.kw_fill,
                      plan.float_values, plan.float_fill, inputs, plan.fresh_slots, outputs, plan.nested_fill)


def graph_node_spec(node: Any) -> GraphNodeSpec:
    """The graph program's view of ``node`` (a genie.server.graphs._Node). C++ may call the op itself only when
    the node runs as a plain call (its op's own dispatch, or the composite kernel it asked for; not a session-bound
    runner) and has no validator (which may read data)."""
    schema = node.op._schema
    kernel = node.kernel.name if node.kernel is not None else ""
    return GraphNodeSpec(schema.name, schema.overload_name, node.args, node.kwargs, node.refs, node.nested,
                         node.kw_refs, node.release, node.zero, kernel,
                         (node.fallback or node.kernel is not None) and node.validator is None)


def runner_binding(store: StorageStore, metrics: SessionMetrics | None) -> RunnerBinding:
    """The binding of a session's runner to ``store`` and ``metrics`` (None: its ops are not counted)."""
    return RunnerBinding(store.tables, None if metrics is None else metrics.ok_tally())
