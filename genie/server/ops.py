"""Op resolution: from a client's op name to a torch ``OpOverload``, safely.

A client names an op as ``"aten::add.Tensor"`` (``namespace::name.overload``;
no overload means ``default``). The name is accepted only if

1. it is a string of sane length whose namespace is ``aten`` or ``prims``
   (``OpOverload.name()`` gives exactly this form; ``.default`` is accepted too),
2. it is registered with the dispatcher (``torch._C._dispatch_get_all_op_names()``),
3. it is not on :data:`DENY_LIST`,
4. it is on the allow-list of reviewed ops (:mod:`genie.server.allowlist`, genie/server/allowed_ops.txt).

Only then is it looked up on ``torch.ops``: the attribute names come from a
*validated registered name*, never from unchecked client input. Anything else
raises :class:`~genie.errors.ForbiddenOpError` saying why.

The deny list refuses ops that reach outside the session's tensors: the
server's files, its stdout, raw storage and pointers, process-global state,
memory-unsafe constructors, and device-side asserts that would poison a CUDA
context shared by every session. Entries are exact op names, or prefixes
ending in ``*``. A test checks every entry still matches a registered op, so a
rename in a new torch release is noticed instead of silently re-allowing it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genie.errors import ForbiddenOpError
from genie.server import sdpa as _sdpa
from genie.server.allowlist import is_allowed, refusal

log = logging.getLogger("genie.server.ops")
_sdpa.install()  # CUDA kernels of the overrideable SDPA ops (genie/server/sdpa.py); inert on CPU

#: Namespaces a client may use.
ALLOWED_NAMESPACES = ("aten", "prims")

_NAME = re.compile(r"^(aten|prims)::([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?$")
_MAX_NAME = 200

#: Refused ops (exact names, or prefixes ending in ``*``) and why.
DENY_LIST: dict[str, str] = {
    "aten::from_file*": "reads a file on the server's filesystem",
    "aten::_print": "prints to the server's stdout",
    "aten::set_.source_Storage*": "points a tensor at a raw storage (arbitrary memory)",
    "aten::set.source_Storage*": "points a tensor at a raw storage (arbitrary memory)",
    "aten::_reshape_alias*": "makes a view without checking it stays inside its storage (out-of-bounds memory access)",
    "aten::_unsafe_index*": "skips index bounds checks on CUDA (out-of-bounds memory access)",
    "aten::_unsafe_masked_index*": "skips index bounds checks on CUDA (out-of-bounds memory access)",
    "aten::_nested_view_from_buffer*": "builds views from client-given offsets without bounds checks",
    "aten::_sparse_coo_tensor_unsafe": "builds a sparse tensor without validating its indices (crashes the server)",
    "aten::_sparse_compressed_tensor_unsafe": "builds a sparse tensor without validating its indices",
    "aten::_sparse_csr_tensor_unsafe": "builds a sparse tensor without validating its indices",
    "aten::_sparse_csc_tensor_unsafe": "builds a sparse tensor without validating its indices",
    "aten::_sparse_bsr_tensor_unsafe": "builds a sparse tensor without validating its indices",
    "aten::_sparse_bsc_tensor_unsafe": "builds a sparse tensor without validating its indices",
    "aten::_sparse_coo_tensor_with_dims_and_tensors*": "builds a sparse tensor without validating its indices",
    "aten::_cufft_set_plan_cache_max_size": "changes process-global cuFFT state shared by every session",
    "aten::_cufft_clear_plan_cache": "changes process-global cuFFT state shared by every session",
    "aten::record_stream": "ties a tensor's memory to a CUDA stream (process-global allocator state)",
    "aten::_assert_async*": "a failing device-side assert poisons the CUDA context for every session",
    "aten::_functional_assert_async*": "a failing device-side assert poisons the CUDA context for every session",
    "aten::pin_memory": "allocates page-locked host memory outside the session's byte quota",
    "aten::_pin_memory*": "allocates page-locked host memory outside the session's byte quota",
}

_lock = threading.Lock()
_registered: frozenset[str] = frozenset()
_registered_at = 0.0
#: A miss re-reads the registry (libraries may register ops late) at most this often.
_REFRESH_INTERVAL = 10.0
_resolved: dict[str, torch._ops.OpOverload] = {}


def registered_op_names(*, refresh: bool = False) -> frozenset[str]:
    """Every op name the dispatcher knows (cached; ``refresh`` re-reads it, at most every 10 s)."""
    global _registered, _registered_at
    with _lock:
        now = time.monotonic()
        if not _registered or refresh and now - _registered_at > _REFRESH_INTERVAL:
            _registered = frozenset(torch._C._dispatch_get_all_op_names())
            _registered_at = now
        return _registered


def deny_reason(name: str) -> str | None:
    """Why ``name`` is refused, or None when it is not on the deny list."""
    for entry, reason in DENY_LIST.items():
        if entry.endswith("*") and name.startswith(entry[:-1]) or name == entry:
            return reason
    return None


def resolve_op(name: object) -> torch._ops.OpOverload:
    """The OpOverload for a client-supplied op name, or ForbiddenOpError saying why not."""
    if isinstance(name, str):
        cached = _resolved.get(name)
        if cached is not None:
            return cached
    if not isinstance(name, str) or len(name) > _MAX_NAME:
        raise ForbiddenOpError(f"op name must be a string of at most {_MAX_NAME} characters, got {_preview(name)}")
    match = _NAME.match(name)
    if match is None:
        raise ForbiddenOpError(
            f"op {_preview(name)} is not allowed: only registered {' and '.join(ALLOWED_NAMESPACES)} ops "
            "named like 'aten::add.Tensor' can run on a genie server"
        )
    # The registry names default overloads without a suffix ("aten::mm"); accept "aten::mm.default" too.
    registered = name if match.group(3) != "default" else name[: -len(".default")]
    if registered not in registered_op_names() and registered not in registered_op_names(refresh=True):
        raise ForbiddenOpError(f"op {name!r} is not a registered torch op (this server runs torch {torch.__version__})")
    reason = deny_reason(registered)
    if reason is not None:
        raise ForbiddenOpError(f"op {name!r} is refused by genie servers: it {reason}")
    _record(name)  # before the allow-list: a recording run collects what a workload needs
    if not is_allowed(registered):
        raise ForbiddenOpError(refusal(name))
    namespace, packet_name, overload = match.group(1), match.group(2), match.group(3) or "default"
    # Attribute names below come from a name validated against the dispatcher's registry.
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError) as exc:
        raise ForbiddenOpError(f"op {name!r} is registered but cannot be called from Python: {exc}") from None
    with _lock:
        _resolved[name] = op
    return op


def _record(name: str) -> None:
    """With ``GENIE_RECORD_OPS=PATH``, append each op name clients ask for (allowed or not) to PATH.

    How the allow-list's "used by the suites" groups were collected (scripts/allowed-ops); off by default.
    """
    path = os.environ.get("GENIE_RECORD_OPS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(name + "\n")


#: A heap address: 0x and at least 8 hex digits (torch puts raw pointers in some error messages).
_POINTER = re.compile(r"0x[0-9a-fA-F]{8,}")
#: A bare hex word of 12 to 16 digits, letters and digits both (an address printed without its 0x).
_BARE_HEX = re.compile(r"(?<![\w.])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{12,16}(?![\w.])")
#: A decimal integer of 4 or more digits (not part of a name or of a float's digits): a word read from memory
#: prints as one. Digits from which a number the call did not give is withheld, when its numbers are known.
_DECIMAL = re.compile(r"(?<![\w.])\d{4,}(?!\w|\.\d)")
#: One of 13 or more digits: withheld when nothing says what the call's own numbers are, 10**12 and up (a
#: user-space address is 14 or 15 digits; a size a client gives, 2**40 included, is shorter).
_LONG_DECIMAL = re.compile(r"(?<![\w.])\d{13,}(?!\w|\.\d)")
#: Characters of a kernel's error text kept before it is scrubbed (a record keeps fewer still: records.py).
_MAX_TEXT = 16000
WITHHELD = "…"


def scrub(message: str, known: frozenset[int] | set[int] | None = None) -> str:
    """``message`` with memory contents taken out: error text sent to clients carries no word a kernel read.

    Every heap address (``0x`` and 8 or more hex digits) becomes ``0x…``, a bare hex word of 12 to 16 digits
    ``…``. Decimal integers go too, as a word read from memory prints in decimal (issue 28: ``_embedding_bag``
    echoed the 8-byte word before its buffer): with ``known`` (the call's own argument values, sizes, strides
    and element counts: :func:`known_numbers`) every number of 4 or more digits that is not one of them;
    without it, every number of 13 or more digits. Shapes, indices and sizes the client gave stay readable.
    """
    message = _POINTER.sub("0x…", message)
    message = _BARE_HEX.sub(WITHHELD, message)
    if known is None:
        return _LONG_DECIMAL.sub(WITHHELD, message)
    return _DECIMAL.sub(lambda m: m.group() if int(m.group()) in known else WITHHELD, message)


#: Most elements of an integer tensor whose values count as the call's own numbers (all of them), and most
#: whose min and max do; larger ones add their shape only.
_VALUES_OF = 1 << 12
_EXTREMES_OF = 1 << 20


def known_numbers(args: Any, kwargs: dict[str, Any]) -> set[int]:
    """The numbers a call gave (for :func:`scrub`): integer arguments and list elements, each tensor's sizes,
    strides, offset, element and byte counts, the products of its leading and trailing sizes, and the values of
    small integer tensors (min and max of larger ones). Called on the error path only."""
    known: set[int] = set()
    stack: list[Any] = [args, list(kwargs.values())]
    while stack:
        value = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            known.add(abs(value))
        elif isinstance(value, float) and value.is_integer():
            known.add(abs(int(value)))
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, torch.Tensor):
            _tensor_numbers(value, known)
    return known


def _tensor_numbers(t: torch.Tensor, known: set[int]) -> None:
    sizes = list(t.shape)
    known.update(sizes)
    if t.layout == torch.strided:
        known.update(abs(s) for s in t.stride())
    known.update((t.dim(), t.numel(), t.numel() * t.element_size(), int(t.storage_offset())))
    lead = trail = 1
    for a, b in zip(sizes, reversed(sizes), strict=True):
        lead, trail = lead * a, trail * b
        known.update((lead, trail))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.device.type == "meta" \
            or t.layout != torch.strided or not t.numel():
        return
    with contextlib.suppress(RuntimeError):
        if t.numel() <= _VALUES_OF:
            known.update(abs(int(v)) for v in t.reshape(-1).tolist())
        elif t.numel() <= _EXTREMES_OF:
            known.update((abs(int(t.min())), abs(int(t.max()))))


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."



def _is_missing_kernel(exc: NotImplementedError) -> bool:
    return str(exc).startswith("Could not run")


def decomposition_of(op: torch._ops.OpOverload) -> Any:
    """The registered decomposition of ``op`` (``torch._decomp``), or its CompositeImplicit kernel, or None."""
    from torch._decomp import decomposition_table

    decomp = decomposition_table.get(op)
    if decomp is not None:
        return decomp
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return op.decompose
    return None


class _DecomposeMissing(TorchDispatchMode):
    """Runs every op it sees; one without a kernel here runs its decomposition (nested ones too)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run_or_decompose(func, args, kwargs or {})


def _run_or_decompose(op: torch._ops.OpOverload, args: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return op(*args, **kwargs)
    except NotImplementedError as exc:
        if not _is_missing_kernel(exc):
            raise
        decomp = decomposition_of(op)
        if decomp is None:
            raise
        log.debug("%s has no kernel on this device; running its decomposition", op.name())
        # The mode is off while its handler runs: enter a fresh one so ops inside the decomposition that
        # lack a kernel are decomposed too.
        with _DecomposeMissing():
            result = decomp(*args, **kwargs)
        if result is NotImplemented:
            raise
        return result


_NO_RULE = object()
_out_rules: dict[torch._ops.OpOverload, Any] = {}


def _out_rule(op: torch._ops.OpOverload) -> Any:
    from genie.server.validators import out_dtype_check  # validators import records, which imports this module

    _out_rules[op] = rule = out_dtype_check(op)
    return rule


def run_op(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Run ``op``; when the server's device has no kernel for it, run its registered decomposition instead.

    The common path is a plain call: the dispatch mode costs a few microseconds
    per op, so it is entered only once a kernel turned out to be missing. The
    decomposition's outputs are checked against the client's like any other op's
    (the executor's mismatch rule): a disagreement is reported, never stored.

    An out form whose out dtypes only its kernel could check (:func:`genie.server.validators.out_dtype_check`)
    is checked here too: the executor runs the out form of an op whose functional result did not fit the
    client's outputs without a pre-flight of its own. A kernel's error leaves with :func:`scrub` applied
    against the call's own numbers.
    """
    rule = _out_rules.get(op, _NO_RULE)
    if rule is _NO_RULE:
        rule = _out_rule(op)
    if rule is not None:
        rule(op.name(), args, kwargs)
    try:
        return _run_or_decompose(op, args, kwargs)
    except Exception as exc:
        text = str(exc)
        if len(text) > _MAX_TEXT:  # torch prints whole tensors in some messages (meshgrid's: 9.4 MB)
            text = f"{text[:_MAX_TEXT]} ... ({len(text) - _MAX_TEXT} more characters)"
        if _DECIMAL.search(text) or _BARE_HEX.search(text):
            text = scrub(text, known_numbers(args, kwargs))
        if text != str(exc):
            exc.args = (text,)
        raise
