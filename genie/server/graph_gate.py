"""The replay gate: a replayed graph's nodes pass the op path's pre-flight, checked once per input signature.

A node of a graph (:mod:`genie.server.graphs`) is an op like any ``CMD_OP``, so it gets the same
refusals, by the same code (:func:`genie.server.preflight.check`): the byte quota before allocation,
the element cap, the validators and index checks, the argument refusals, the split limit. What is
particular to a graph is the quota: a node's intermediates are not the session's storages, yet they
hold memory until their last use. So a checked replay (:class:`CheckedReplay`) follows them storage
by storage (a view keeps its base's bytes alive; an input's storage is the store's, counted there)
and gives each node the quota left after what is alive before it.

The pre-flight's answers depend on the op and its arguments' shapes, strides, dtypes and plain values
only, and a node's arguments are fixed by the graph's inputs: so what the first replay of an input
signature found is that signature's :class:`Gate` (per node, the bytes alive before it and the bytes
it allocates), and a later replay only compares the peak with what the quota leaves. The checks that
read data (validators, index checks) are not the signature's: they run before their node on every
replay. A node the pre-flight cannot plan (no meta kernel; an output whose size depends on data, and
so every node after it), or one that returns a number (which may come from data and feed a later
node's arguments), makes no gate: each replay of that signature is checked in full, and an unplanned
node's intermediates are measured after it ran (as the op path measures what such an op stored).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from genie.errors import QuotaExceededError
from genie.server import preflight
from genie.server.records import tensor_leaves

if TYPE_CHECKING:
    from genie.server.executor import Executor


class Gate:
    """What the checked replay of one input signature found: per node, the bytes alive before it (intermediates
    and what nodes grew the inputs by) and the bytes it allocates, as the pre-flight counted them."""

    __slots__ = ("before", "grew", "new", "peak")

    def __init__(self, before: list[int], new: list[int], grew: bool = False) -> None:
        self.before = before
        self.new = new
        self.peak = max((b + n for b, n in zip(before, new, strict=True)), default=0)
        #: whether a node grew an input's storage (a resize_, set_ or out= into a storage too small for it): a
        #: replay of the signature reallocates that storage, which a CUDA graph's fixed addresses cannot follow
        self.grew = grew

    def over(self, remaining: int | None) -> tuple[int, int, int] | None:
        """The first node that would cross the quota with ``remaining`` bytes left (None: no quota), as (its
        index, the bytes it allocates, the bytes left to it); None when the replay fits."""
        if remaining is None or self.peak <= remaining:
            return None
        for i, (before, new) in enumerate(zip(self.before, self.new, strict=True)):
            if before + new > remaining:
                return i, new, max(0, remaining - before)
        return None  # pragma: no cover - the peak is one of the sums


class CheckedReplay:
    """One replay checked in full: each node through :func:`genie.server.preflight.check` before it runs, with
    the quota left after the bytes alive then; the intermediates' storages followed from node to node."""

    def __init__(self, ex: Executor, remaining: int | None) -> None:
        self.ex = ex
        #: bytes left of the session's quota when the replay began (None: no quota)
        self.remaining = remaining
        self.inputs = {s._cdata for s in ex.used_storages().values()}
        self.sizes: dict[int, int] = {}  # intermediate storage -> its bytes
        self.holders: dict[int, int] = {}  # intermediate storage -> how many live slots hold it
        self.slots: dict[int, set[int]] = {}  # slot -> the intermediate storages it holds
        self.alive = 0  # bytes of the intermediate storages alive
        self.grown = 0  # what nodes grew the inputs' storages by (and non-strided results): held to the end
        self.before: list[int] = []
        self.new: list[int] = []
        self.cacheable = True
        self.grew = False  # a node grew an input's storage

    def check(self, op: torch._ops.OpOverload, label: str, args: Any, kwargs: Any) -> None:
        """The op path's pre-flight for the next node, on its actual arguments (raises its refusal)."""
        held = self.alive + self.grown
        left = None if self.remaining is None else max(0, self.remaining - held)
        found = preflight.check(op, label, args, kwargs, max_elements=self.ex.max_op_elements, remaining_bytes=left)
        self.cacheable = self.cacheable and found.planned
        self.before.append(held)
        self.new.append(found.new_bytes)

    def ran(self, label: str, resizes: bool, slot: int, result: Any) -> None:
        """The node filling ``slot`` returned ``result``: follow its storages; QuotaExceededError when what is alive
        now is past the quota (a node the pre-flight could not plan is measured here, after it ran)."""
        if _holds_number(result):
            # A number may come from data (a node's later arguments then change with the values, not the
            # signature): this signature gets no gate, and each of its replays is checked in full.
            self.cacheable = False
        keys: set[int] = set()
        for t in tensor_leaves(result):
            if t.layout != torch.strided:
                self.grown += t.numel() * t.element_size()
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.inputs:
                continue
            nbytes = storage.nbytes()
            self.alive += nbytes - self.sizes.get(key, 0)
            self.sizes[key] = nbytes
            keys.add(key)
        for key in keys:
            self.holders[key] = self.holders.get(key, 0) + 1
        if keys:
            self.slots[slot] = keys
        if resizes:
            store = self.ex.store
            grown = [max(0, s.nbytes() - store.nbytes(i)) for i, s in self.ex.used_storages().items() if i in store]
            self.grown = sum(grown)
            self.grew = self.grew or any(grown)
        if self.remaining is not None and self.alive + self.grown > self.remaining:
            raise QuotaExceededError(
                f"{label} left {self.alive + self.grown} bytes of intermediates alive, more than the "
                f"{self.remaining} bytes left of this session's limit (max_session_bytes)")

    def release(self, slot: int) -> None:
        """``slot`` was dropped after its last use: a storage no live slot holds any more is freed."""
        for key in self.slots.pop(slot, ()):
            self.holders[key] -= 1
            if not self.holders[key]:
                del self.holders[key]
                self.alive -= self.sizes.pop(key)

    def gate(self) -> Gate | None:
        """What a later replay of the signature needs, or None when each must be checked in full."""
        return Gate(self.before, self.new, self.grew) if self.cacheable else None


_NUMBERS = (int, float, complex)  # bool is an int


def _holds_number(value: Any) -> bool:
    if isinstance(value, _NUMBERS):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_number(v) for v in value)
    return False
