"""The validators of a graph captured as a CUDA graph, run before each of its replays.

A validator (:mod:`genie.server.validators`, :mod:`genie.server.index_checks`) may read its node's data: the
embedding backward's indices, a CTC loss's targets. A CUDA graph capture records kernels without running them,
so it cannot read data (a sync during capture breaks it), and a replay runs no Python at all. So while
:mod:`genie.server.cuda_graphs` captures a graph, each validator's call is recorded here instead of run
(:meth:`HoistedChecks.record`), and before the captured graph's first replay and every later one the recorded
calls run (:meth:`HoistedChecks.run`) on the replay's inputs, read as they are at that moment (each check's data
read waits for the GPU's work queued before it).

What a recorded call keeps: an argument that is one of the graph's inputs (or an item of a list input), by its
place, so each replay's own input is checked; every other tensor, an intermediate the graph computes, as a fake
tensor (``torch._subclasses.FakeTensor``) of the same device, shape, strides and dtype, which answers every
question about its metadata and raises on any read of its data. An input that a node of the graph may write to (in-place, ``out=``, directly
or through a view of it: :func:`written_inputs`) may change before a later node's check reads it, so the
caller records it as a fake tensor too: only checks that read none of its data run ahead. A captured replay's inputs have the signature of the capture (same addresses,
shapes, strides, dtypes and plain values: the caller's rule), so the intermediates' metadata are the capture's.

A captured graph is used only if the recorded calls run as they would have in the capture (:meth:`verify`, once,
right after the capture): none reads an intermediate's data (the fake tensor raised), none refuses (a check
given fake tensors may refuse what it would pass on real ones: the graph is not trusted with it), and none
replaces an argument (a check may serve a kernel a contiguous copy, or ``unsafe=False``: the capture ran the
node without it). Otherwise the graph stays eager, each validator before its node, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from genie.errors import GenieError
from genie.wire.graph import Ref

Check = Callable[[str, list[Any], dict[str, Any]], None]


class NotHoistable(Exception):
    """A recorded check cannot run ahead of its graph: it reads an intermediate, refuses the capture's own
    metadata or replaces an argument (the message says which node and why)."""


class HoistedCheckFailed(Exception):
    """A recorded check refused a replay's inputs: ``node`` is the node's index, ``error`` the check's refusal."""

    def __init__(self, node: int, error: Exception) -> None:
        super().__init__(str(error))
        self.node = node
        self.error = error


class _Input:
    """A recorded argument that is the graph's input ``slot`` (its ``item`` where the input is a list)."""

    __slots__ = ("item", "slot")

    def __init__(self, slot: int, item: int) -> None:
        self.slot = slot
        self.item = item


class HoistedChecks:
    """The recorded validator calls of one capture, over the capture's inputs (``inputs``: the replay
    environment's input slots at capture; None where an input is to stand in as a fake tensor). ``run_too``: each
    recorded call also runs, as it is recorded (a replay that runs its nodes while recording them)."""

    def __init__(self, inputs: list[Any], run_too: bool = False) -> None:
        self.run_too = run_too
        self._places: dict[int, _Input] = {}
        for slot, value in enumerate(inputs):
            if isinstance(value, (list, tuple)):
                for item, v in enumerate(value):
                    if isinstance(v, torch.Tensor):
                        self._places.setdefault(id(v), _Input(slot, item))
            if isinstance(value, torch.Tensor):
                self._places[id(value)] = _Input(slot, -1)
        self._calls: list[tuple[int, Check, str, list[Any], dict[str, Any]]] = []
        self._fakes = FakeTensorMode(allow_non_fake_inputs=True)

    def __len__(self) -> int:
        return len(self._calls)

    def record(self, node: int, check: Check, label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Keep node ``node``'s call ``check(label, args, kwargs)`` for the replays (and run it with ``run_too``)."""
        self._calls.append((node, check, label, [self._template(a) for a in args],
                            {k: self._template(v) for k, v in kwargs.items()}))
        if self.run_too:
            check(label, args, kwargs)

    def _template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            place = self._places.get(id(value))
            if place is not None:
                return place
            return self._fakes.from_tensor(value, static_shapes=True)
        if isinstance(value, (list, tuple)):
            return type(value)(self._template(v) for v in value)
        return value

    def verify(self, env: list[Any]) -> None:
        """Run the recorded calls once, on the replay's inputs, right after the capture: NotHoistable where one
        cannot run ahead of the graph (the module's docstring), a refusal included."""
        try:
            self._run(env, strict=True)
        except HoistedCheckFailed as failed:
            raise NotHoistable(f"node {failed.node}'s check refused the capture's arguments ({failed.error}); "
                               "it runs before its node instead") from None

    def run(self, env: list[Any]) -> None:
        """Run the recorded calls on this replay's inputs: HoistedCheckFailed naming the first that refuses."""
        self._run(env, strict=False)

    def _run(self, env: list[Any], strict: bool) -> None:
        for node, check, label, args, kwargs in self._calls:
            given = [_fill(a, env) for a in args]
            given_kw = {k: _fill(v, env) for k, v in kwargs.items()}
            before = (_snapshot(given), _snapshot(list(given_kw.values())), list(given_kw))
            try:
                check(label, given, given_kw)
            except GenieError as exc:
                raise HoistedCheckFailed(node, exc) from None
            except Exception as exc:  # a read of a fake tensor: the check reads an intermediate's data
                if not strict:
                    raise HoistedCheckFailed(node, exc) from None
                raise NotHoistable(f"node {node} ({label}): its check reads data the graph computes "
                                   f"({type(exc).__name__}: {str(exc)[:120]})") from None
            if strict and not (_same(before[0], given) and _same(before[1], list(given_kw.values()))
                               and before[2] == list(given_kw)):
                raise NotHoistable(f"node {node} ({label}): its check replaces an argument, which the capture "
                                   "ran without")


def written_inputs(graph: Any) -> set[int]:
    """The input slots of ``graph`` (a :class:`genie.server.graphs.Graph`) that a node may write to: an argument the
    op's schema marks written (``Tensor(a!)``) that is an input, or a node's result that may alias an input (an op
    whose schema lets a result alias an argument: views, in-place and ``out=`` ops), item by item, transitively."""
    aliases: dict[int, frozenset[int]] = {slot: frozenset([slot]) for slot in range(graph.inputs)}
    written: set[int] = set()
    for k, node in enumerate(graph.nodes):
        reach: frozenset[int] = frozenset()
        schema = node.op._schema.arguments
        given = [*zip(schema, node.args, strict=False),
                 *((a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs)]
        for argument, value in given:
            if argument.alias_info is None:
                continue
            touched = frozenset().union(*(aliases.get(slot, frozenset()) for slot in _slots(value)))
            reach |= touched
            if argument.alias_info.is_write:
                written |= touched
        aliases[graph.inputs + k] = reach
    return written


def _slots(value: Any) -> list[int]:
    """The slots the references in an argument template name (genie.wire.graph.Ref, lists of them)."""
    if type(value) is Ref:
        return [value.slot]
    if isinstance(value, (list, tuple)):
        return [slot for v in value for slot in _slots(v)]
    return []


def shown(graph: Any, inputs: list[Any]) -> list[Any]:
    """The inputs a recording keeps by their place: ``inputs`` but those a node may write to (None: they stand in
    as fake tensors, see :func:`written_inputs`)."""
    written = written_inputs(graph) if graph.writes else set()
    return [None if slot in written else v for slot, v in enumerate(inputs)]


@contextmanager
def recording(graph: Any, inputs: list[Any], run_too: bool = False) -> Iterator[HoistedChecks]:
    """While inside, ``graph``'s (a :class:`genie.server.graphs.Graph`) validators are recorded into the yielded
    HoistedChecks instead of run, or as well with ``run_too`` (``inputs``: the replay environment's input slots,
    each input a node may write to left out: :func:`shown`)."""
    checks = HoistedChecks(shown(graph, inputs), run_too)
    graph.recording.append(checks)
    try:
        yield checks
    finally:
        graph.recording.clear()


def _fill(value: Any, env: list[Any]) -> Any:
    if type(value) is _Input:
        v = env[value.slot]
        return v if value.item < 0 else v[value.item]
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, env) for v in value)
    return value


def _snapshot(values: Any) -> list[Any]:
    """An argument list's items, its lists copied (a check may replace an item of a list in place)."""
    return [_snapshot(v) if isinstance(v, (list, tuple)) else v for v in values]


def _same(before: list[Any], after: Any) -> bool:
    """Whether a check left its argument list as it was (``before``: its :func:`_snapshot`): the same objects,
    lists compared item by item, equal plain values."""
    if not isinstance(after, (list, tuple)) or len(before) != len(after):
        return False
    for a, b in zip(before, after, strict=True):
        if a is b:
            continue
        if isinstance(a, list) and _same(a, b):
            continue
        if type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b:
            continue
        return False
    return True
