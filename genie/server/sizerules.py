"""Output rules for allowed ops that have no meta kernel and whose outputs are *not* bounded by their inputs.

The pre-flight (:mod:`genie.server.preflight`) leaves an op it cannot run on meta tensors to the real kernel
and the quota check after it, which is sound when the outputs are no bigger than the inputs (``nonzero``,
``unique``). The histogram ops break that: their bin counts are numbers, so a 10-element input with
``bins=2**24`` allocated a 64 MiB histogram (``histogram.bin_ct``) and ``histogramdd`` with four bins of
65,536 asked for 2**64 elements, before any quota could see them (found by tests/security/fuzz_ops.py).

Each rule here makes the op's outputs on meta tensors from the bound arguments, as its CPU kernel shapes them
(checked against it in tests/server/test_size_rules.py), so the pre-flight's element cap and byte
quota refuse them before anything is allocated. A rule raises what the kernel would for bins below 1 or
a mismatched dimension count. Only shapes are worked out; the data (ranges, weights) is the kernel's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_aten = torch.ops.aten
_META = torch.device("meta")

Rule = Callable[[dict[str, Any]], Any]


def _bins(values: list[int]) -> list[int]:
    for dim, count in enumerate(values):
        if not isinstance(count, int) or count <= 0:
            raise RuntimeError(f"bins must be > 0, but got {count} for dimension {dim}")
    return values


def _empty(sizes: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(sizes, dtype=like.dtype, device=_META)


def _histogram(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x = a["self"]
    (bins,) = _bins([a.get("bins", 100)])
    return _empty([bins], x), _empty([bins + 1], x)


def _histogram_out(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    (bins,) = _bins([a.get("bins", 100)])
    hist, edges = a["hist"], a["bin_edges"]
    hist.resize_([bins])
    edges.resize_([bins + 1])
    return hist, edges


def _dd_counts(a: dict[str, Any]) -> list[Any]:
    """The per-dimension ``bins`` (ints, or the bin-edge tensors of ``TensorList_bins``), one per input dim."""
    x = a["self"]
    if x.dim() < 2:
        raise RuntimeError("torch.histogramdd: input tensor should have at least 2 dimensions")
    bins = a["bins"]
    counts = [bins] * x.size(-1) if isinstance(bins, int) else list(bins)
    if len(counts) != x.size(-1):
        raise RuntimeError("histogramdd: The size of bins must be equal to the innermost dimension of the input.")
    return counts


def _histogramdd(a: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = a["self"]
    counts = _bins(_dd_counts(a))
    return _empty(counts, x), [_empty([n + 1], x) for n in counts]


def _histogramdd_tensors(a: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = a["self"]
    edges = _dd_counts(a)  # the bin-edge tensors, one per dimension
    counts = _bins([e.numel() - 1 for e in edges])
    return _empty(counts, x), [_empty([n + 1], x) for n in counts]


def _bin_edges(a: dict[str, Any]) -> list[torch.Tensor]:
    """``_histogramdd_bin_edges``: one edge tensor of n + 1 per dimension (what ``histogramdd`` sends first)."""
    return [_empty([n + 1], a["self"]) for n in _bins(_dd_counts(a))]


def _from_bin_cts(a: dict[str, Any]) -> torch.Tensor:
    return _empty(_bins(_dd_counts(a)), a["self"])


def _from_bin_tensors(a: dict[str, Any]) -> torch.Tensor:
    return _empty(_bins([e.numel() - 1 for e in _dd_counts(a)]), a["self"])


RULES: dict[Any, Rule] = {
    _aten.histogram.bin_ct: _histogram,
    _aten.histogram.bin_ct_out: _histogram_out,
    _aten.histogramdd.default: _histogramdd,
    _aten.histogramdd.int_bins: _histogramdd,
    _aten.histogramdd.TensorList_bins: _histogramdd_tensors,
    _aten._histogramdd_bin_edges.default: _bin_edges,
    _aten._histogramdd_from_bin_cts.default: _from_bin_cts,
    _aten._histogramdd_from_bin_tensors.default: _from_bin_tensors,
}


def run(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The meta outputs of ``op`` (a key of :data:`RULES`) on meta ``args``/``kwargs`` as sent."""
    names = (a.name for a in op._schema.arguments)
    return RULES[op](dict(zip(names, args, strict=False)) | kwargs)
