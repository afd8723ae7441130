"""Output metadata on the client: meta tensors, cached per op signature.

For a fire-and-forget op the client must know each output's dtype, shape,
strides and storage offset before the server has run it. The first time an op
is seen with a given signature (argument metadata and values), it runs on
``meta`` tensors; the result is cached, so the next identical call costs a
dictionary lookup.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from genie import lazy_dynamo

#: Output description: (dtype, shape, stride, storage offset) or None for a non-tensor.
OutMeta = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]

_CACHE_LIMIT = 65536


class NeedsServer(Exception):
    """Meta tensors cannot answer this op (data-dependent shape, no meta kernel, a number result)."""


class MetaCache:
    """Caches op output metadata keyed on the op and its arguments' metadata."""

    def __init__(self) -> None:
        self._cache: dict[Any, Any] = {}
        self.hits = 0
        self.misses = 0

    def lookup(self, key: Any) -> Any:
        found = self._cache.get(key)
        if found is not None:
            self.hits += 1
        return found

    def store(self, key: Any, value: Any) -> None:
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = value
        self.misses += 1


def storage_numel(shape: Any, stride: Any, offset: int) -> int:
    """Elements a storage needs to hold a tensor of this layout."""
    if any(s == 0 for s in shape):
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def to_meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the same dtype, shape, strides and storage offset as ``t``."""
    shape, stride, offset = t.shape, t.stride(), int(t.storage_offset())
    base = torch.empty(storage_numel(shape, stride, offset), dtype=t.dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def describe(out: Any) -> tuple[list[OutMeta | None], Any]:
    """Flatten an op's meta result into output descriptions and the pytree spec."""
    flat, spec = tree_flatten(out)
    metas: list[OutMeta | None] = []
    for o in flat:
        if isinstance(o, torch.Tensor):
            metas.append((o.dtype, tuple(o.shape), tuple(o.stride()), int(o.storage_offset())))
        else:
            metas.append(None)
    return metas, spec


def warm_first_op() -> None:
    """Off the caller's thread: what the first op would otherwise wait for (:func:`genie.lazy_dynamo.defer`, then
    ``sympy``, which torch's Python meta kernels import for type promotion: ~500 modules). ``genie.init``
    starts it before its network waits; an op that needs them meanwhile waits on the import lock."""

    def warm() -> None:
        lazy_dynamo.defer()
        try:
            import sympy  # noqa: F401
        except ImportError:  # torch imports it lazily too; without it, its meta kernels fail as they would anyway
            pass

    threading.Thread(target=warm, name="genie-warm-imports", daemon=True).start()


def run_meta(func: Any, args: Any, kwargs: Any, convert: Any) -> tuple[list[OutMeta | None], Any, list[Any]]:
    """Run ``func`` on meta tensors; raise NeedsServer when meta cannot answer.

    Errors the real kernel would raise too (a shape mismatch, a bad dtype)
    propagate unchanged, so they surface at the line that caused them.
    """
    lazy_dynamo.defer()
    meta_args = tree_map(convert, args)
    meta_kwargs = tree_map(convert, kwargs)
    try:
        out = func(*meta_args, **meta_kwargs)
    except NotImplementedError as exc:
        raise NeedsServer(str(exc)) from None
    except RuntimeError as exc:
        text = str(exc)
        lowered = text.lower()
        if ("meta" in lowered and ("not implemented" in lowered or "backend" in lowered or "meta tensors" in lowered)) or (
            "data-dependent" in text or "DataDependent" in type(exc).__name__ or "Dynamic" in type(exc).__name__
        ):
            raise NeedsServer(text) from None
        raise
    except Exception as exc:
        if type(exc).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException",
                                  "GuardOnDataDependentSymNode", "UnsupportedOperatorException"):
            raise NeedsServer(str(exc)) from None
        raise
    metas, spec = describe(out)
    flat, _ = tree_flatten(out)
    if any(m is None and not isinstance(o, (bool, int, float, type(None))) for m, o in zip(metas, flat, strict=True)):
        raise NeedsServer("op returns values meta tensors cannot compute")
    return metas, spec, flat
