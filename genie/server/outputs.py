"""Where an op's results go: the output rule of the wire contract, and CALL results.

For each output descriptor of a ``CMD_OP`` (see :mod:`genie.wire.messages`):

- a storage the session holds (in-place ops, ``out=``, views) must end up holding
  the result in the described tensor: nothing to do when the result already is
  that tensor, else the result is copied in;
- an unknown storage adopts the result's storage when the result is fresh (no
  storage of the session), fills every byte of it, has exactly ``storage_nbytes``
  bytes and the described layout; else a zeroed storage of ``storage_nbytes`` is made and the result
  copied into the described tensor.

dtype or size disagreement between the result and the descriptor is a
*mismatch*, as is a view laid out differently from what the client computed
(copying would break aliasing): the command fails, nothing is stored silently.

:func:`store_outputs` is the rule; :func:`adopt_described` is its common cases in a few comparisons
(every result fresh, dense and laid out as described, or already the described tensor), for the
per-command plans: anything else it leaves to :func:`store_outputs`. The native runner
(genie/csrc/server/runner.cpp) implements the same common cases and hands the rest back to Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from genie.server.codec import Descriptor, describe
from genie.server.store import StorageStore

_Tensor = torch.Tensor
_STRIDED = torch.strided


class OutputMismatch(Exception):
    """The server's result disagrees with the client's descriptor (internal; becomes kind ``mismatch``)."""


def flatten_outputs(value: Any) -> list[torch.Tensor | None]:
    """An op's returned tensors in schema order; None where it returned an undefined tensor."""
    if isinstance(value, torch.Tensor) or value is None:
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten_outputs(v)]
    return []  # numbers and other non-tensor returns have no descriptor


def _storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    storage = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    return storage.data_ptr() if storage.nbytes() else -1


def store_outputs(op: str, result: Any, outs: list[Descriptor | None], store: StorageStore,
                  held: set[int], tensor_of: Callable[[Descriptor], torch.Tensor]) -> list[Exception]:
    """Apply the output rule; raises OutputMismatch, returns per-output store failures (quota) to report.

    ``held`` is the storage keys (data pointers) of every storage the command used:
    a result over one of them is not fresh and is never adopted under a new id.
    ``tensor_of`` builds the described tensor over a known storage (bounds checked).
    """
    # An op that returns nothing (``-> ()``: _fused_adamw_, _fused_sgd_) gives None from Python, which would
    # read as one undefined tensor; the client expects no output of it.
    results = flatten_outputs(result) if result is not None or outs else []
    if len(results) != len(outs):
        raise OutputMismatch(f"it returned {len(results)} outputs, the client expected {len(outs)}")
    for i, (t, desc) in enumerate(zip(results, outs, strict=True)):
        if desc is not None:
            _check(i, t, desc)
    failures: list[Exception] = []
    for i, (t, desc) in enumerate(zip(results, outs, strict=True)):
        if desc is None or t is None or desc.storage_id == 0:
            continue  # nothing to keep: undefined, or an empty storage on the client
        try:
            _place(i, t, desc, store, held, tensor_of)
        except OutputMismatch:
            raise
        except Exception as exc:  # quota, or a copy that failed: that output only
            failures.append(exc)
    return failures


def _check(i: int, t: torch.Tensor | None, desc: Descriptor) -> None:
    where = f"output {i} (storage {desc.storage_id})"
    if t is None:
        raise OutputMismatch(f"{where} is undefined here, the client expected a {desc.dtype} tensor")
    if t.layout != torch.strided:
        raise OutputMismatch(f"{where} is a {t.layout} tensor; genie servers keep strided tensors only")
    if t.dtype != desc.dtype:
        raise OutputMismatch(f"{where} has dtype {t.dtype} here, the client expected {desc.dtype}")
    if tuple(t.shape) != desc.sizes:
        raise OutputMismatch(f"{where} has sizes {list(t.shape)} here, the client expected {list(desc.sizes)}")


def _place(i: int, t: torch.Tensor, desc: Descriptor, store: StorageStore, held: set[int],
           tensor_of: Callable[[Descriptor], torch.Tensor]) -> None:
    storage = store.get(desc.storage_id)
    if storage is not None:
        same = _storage_key(t) == _storage_key(storage)
        if same and desc.matches(t):
            return  # in-place, out= or a view: the result already lives where the client says
        if same:
            raise OutputMismatch(
                f"output {i} (storage {desc.storage_id}) is a view with strides {list(t.stride())} and offset "
                f"{t.storage_offset()} here, the client expected strides {list(desc.strides)} and offset "
                f"{desc.offset}; a view cannot be re-laid out without breaking aliasing")
        tensor_of(desc).copy_(t)
        return
    fresh = t.untyped_storage()
    key = _storage_key(fresh)
    # Adopt only a result that covers every byte of its storage: gaps in a strided result could hold
    # memory nobody wrote (another session's, once freed).
    dense = t.numel() * t.element_size() == fresh.nbytes()
    if key not in held and dense and fresh.nbytes() == desc.storage_nbytes and desc.matches(t):
        store.put(desc.storage_id, fresh)
        held.add(key)  # a second output over the same fresh storage must not adopt it again
        return
    desc.check(None)
    made = store.make(desc.storage_id, desc.storage_nbytes, t.device)
    desc.over(made).copy_(t)


def adopt_described(result: Any, descs: Sequence[Descriptor | None], slots: Sequence[int], ids: Sequence[int],
                    store: StorageStore, used: dict[int, torch.UntypedStorage]) -> list[Exception] | None:
    """The output rule's common cases: every result fresh, dense and laid out as its descriptor says (adopted
    under its id, ``ids[slot]``), or already the described tensor of a storage the session holds (in place).
    Returns the per-output store failures (quota), as :func:`store_outputs` does; None, with nothing stored,
    when any result is something else: :func:`store_outputs` then decides. ``used``: the storages the
    command used (a result over one of them is not fresh)."""
    storages = store.tables.storages
    if len(descs) == 1 and type(result) is _Tensor and descs[0] is not None:
        # One output (most ops): the fresh case in a few comparisons.
        only = descs[0]
        storage_id = ids[slots[0]]
        fresh = result.untyped_storage()
        nbytes = fresh.nbytes()
        if nbytes == only.storage_nbytes and nbytes and storage_id not in storages \
                and result.dtype == only.dtype and result.shape == only.sizes and result.stride() == only.strides \
                and result.storage_offset() == only.offset and result.layout == _STRIDED \
                and result.numel() * result.element_size() == nbytes:
            key = fresh.data_ptr()
            for storage in used.values():
                if storage.data_ptr() == key and storage.nbytes():
                    break  # the result lives in an input's storage: not fresh
            else:
                try:
                    store.adopt(storage_id, fresh, nbytes)
                except Exception as exc:  # noqa: BLE001 - quota: reported as store_outputs reports it
                    return [exc]
                return []
    results = [result] if type(result) is _Tensor else flatten_outputs(result) if result is not None else []
    if len(results) != len(descs):
        return None
    held: set[int] | None = None
    adopt: dict[int, torch.UntypedStorage] = {}
    for t, desc, slot in zip(results, descs, slots, strict=True):
        if desc is None:
            continue  # an output the client does not keep
        if t is None or t.layout != _STRIDED or t.dtype != desc.dtype or t.shape != desc.sizes \
                or t.stride() != desc.strides or t.storage_offset() != desc.offset:
            return None
        storage_id = ids[slot]
        fresh = t.untyped_storage()
        nbytes = fresh.nbytes()
        if not nbytes or storage_id in adopt:
            return None
        known = storages.get(storage_id)
        if known is not None:
            if known.data_ptr() != fresh.data_ptr():
                return None  # a copy into the known storage: store_outputs does it
            continue
        if held is None:
            held = {s.data_ptr() for s in used.values() if s.nbytes()}
        key = fresh.data_ptr()
        if key in held or nbytes != desc.storage_nbytes or t.numel() * t.element_size() != nbytes:
            return None
        held.add(key)
        adopt[storage_id] = fresh
    failures: list[Exception] = []
    for storage_id, fresh in adopt.items():
        try:
            store.adopt(storage_id, fresh, fresh.nbytes())
        except Exception as exc:  # noqa: BLE001 - quota: that output only, as store_outputs reports it
            failures.append(exc)
    return failures


def store_call_result(result: Any, storage_ids: list[int], store: StorageStore, held: set[int]) -> Any:
    """Keep each tensor of a CALL result under the next id and describe it; other values pass through.

    A result over a storage the session already holds (a view of an input) is
    copied first: one storage never gets two ids.
    """
    pending = iter(storage_ids)

    def keep(t: torch.Tensor) -> list[Any]:
        storage_id = next(pending, None)
        if storage_id is None:
            raise OutputMismatch(f"it returned more tensors than the {len(storage_ids)} storage ids the CALL gave")
        if t.layout != torch.strided:
            raise OutputMismatch(f"it returned a {t.layout} tensor; genie servers keep strided tensors only")
        if t.untyped_storage().nbytes() == 0:
            return describe(0, t)  # an empty storage is never kept
        if _storage_key(t) in held:
            t = t.clone()
        store.put(storage_id, t.untyped_storage())
        held.add(_storage_key(t))
        return describe(storage_id, t)

    from genie.server.codec import encode_result

    return encode_result(result, keep)


def fits_outs(result: Any, outs: Sequence[Descriptor | None]) -> bool:
    """Whether a functional form's results have the dtypes and sizes of an out= op's out descriptors."""
    results = [result] if isinstance(result, torch.Tensor) else list(result)
    return len(results) == len(outs) and all(
        isinstance(t, torch.Tensor) and d is not None and t.dtype == d.dtype and tuple(t.shape) == d.sizes
        for t, d in zip(results, outs, strict=True))


def functional_of(op: torch._ops.OpOverload) -> tuple[tuple[str, ...], torch._ops.OpOverload | None]:
    """(names of ``op``'s out arguments, the overload of the same op that takes the same other arguments
    and mutates nothing), or ``((), None)`` when ``op`` is not an out= op with plain Tensor outs or has no
    such overload (``aten::mse_loss.out`` -> ``aten::mse_loss``; ``sum.IntList_out`` -> ``sum.dim_IntList``)."""
    schema = op._schema
    outs = [a for a in schema.arguments if a.is_out]
    if not outs or any(str(a.type) != "Tensor" for a in outs) or len(schema.returns) != len(outs):
        return (), None
    inputs = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments if not a.is_out]
    packet = getattr(getattr(torch.ops, schema.name.split("::")[0]), op._overloadpacket.__name__)
    for overload in packet.overloads():  # names from the dispatcher's own registry, never from a client
        candidate = getattr(packet, overload)
        other = candidate._schema
        if any(a.is_out or (a.alias_info is not None and a.alias_info.is_write) for a in other.arguments):
            continue
        if [(a.name, str(a.type), a.kwarg_only) for a in other.arguments] == inputs \
                and len(other.returns) == len(outs):
            return tuple(a.name for a in outs), candidate
    return (), None

