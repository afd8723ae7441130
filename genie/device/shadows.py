"""Host shadows: the bytes of small remote storages this client already knows, so reading them needs no round trip.

A tensor uploaded from the CPU (``x.to(device)``, ``torch.tensor(v, device=...)``, CPU indices moved to the
device) keeps a copy of its storage's bytes here: its *shadow*. Reads of the storage (``.item()``,
``bool()``, ``.tolist()``, ``.cpu()``, printing) are answered from the shadow, with no round trip, until
something may write the storage. Library code reads its own inputs often (Hugging Face's padding and
special-token checks, ``generate``'s ``(mask == 1).all()``); at 30 ms RTT each such read costs 30 ms.

*Derived* shadows: when every remote input of an op has a shadow and the op's CPU result is bit-identical to
what any server computes (:data:`MOVE_OPS`, and :data:`INT_OPS` on integer and bool tensors only), the client
runs the op on the shadows as well as sending it, so its output has a shadow too. ``fill_``/``zero_`` of a
whole small storage (``torch.ones(..., device=...)``) make one from nothing.

The rule for bit-identical results: ops that move, select, compare or test values (indexing, concatenation,
copies, comparisons, ``any``/``all``, ``isin``, ``where``, ``fill_``) are exact in every dtype but complex;
integer arithmetic and integer reductions (``add``, ``mul``, ``cumsum``, ``sum``, ``max``) are exact on
integer and bool tensors (wrap-around is two's complement everywhere); every floating-point computation
(``add`` of floats, a float ``sum``, ``softmax``) is refused: its CPU result may differ from a GPU's in the
last bit (order of reduction, fused multiply-add). Division and shifts are refused (a division by zero or
an oversized shift is an error on one kind and a value on another). Copies between dtypes are kept only
where the conversion is exact (same dtype, from integers or bools, or widening floats).

Never a stale answer: a shadow is dropped whenever a command may write its storage. Every command that
writes reaches one of these:

- the Python op path (:func:`after_op`): every argument the op's schema marks as written (in-place ops,
  ``out=``, ``_foreach_*_``, fused optimizer steps) loses its shadow unless the op was derived on it;
- ``genie._C``'s native op path (``genie/csrc/device/fastpath.cpp``) steps aside to Python for any call that
  writes a shadowed storage, so it never writes one; also for calls Python can derive (every tensor read
  shadowed), reads and copies of a shadowed tensor, and ``fill_``/``zero_`` of small storages;
- copies (:func:`after_copy`), ``resize_``/``set_`` growing a storage (a shadow of another size is never
  read: :func:`host_view` checks), a compiled graph's replay (:func:`forget_tensors` on its inputs).

Frees: storage ids are never reused, and ``genie._C`` forgets a freed storage's mark; :meth:`ShadowTable.reap`
drops its bytes. The table is bounded: tensors up to ``GENIE_SHADOW_MAX_BYTES`` (default 64 KiB; 0 turns
shadows off) and ``GENIE_SHADOW_BUDGET`` bytes in all (default 16 MiB, least recently used out first).
Parameters (tensors that require grad when uploaded) are not shadowed: an optimizer writes them each step.
A shadow written by ``GENIE_SHADOW_IDLE_WRITES`` (default 16; 0: never) derived ops in a row without being used
(read here, or an input of a derivation of another storage) is dropped: its writes cost Python's path and saved
nothing (:meth:`ShadowTable.written`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from genie import _C
from genie.device.stats import STATS
from genie.errors import ConfigError

_aten = torch.ops.aten

DEFAULT_MAX_TENSOR_BYTES = 64 << 10
DEFAULT_BUDGET_BYTES = 16 << 20
#: Derived writes to a shadow in a row, none of them followed by a use of it, after which it is dropped.
DEFAULT_IDLE_WRITES = 16


def _env_int(name: str, default: int, expected: str = "a whole number of bytes >= 0 (0 turns host shadows off)") -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(name, raw, f"environment variable {name}", expected)
    return value


class ShadowTable:
    """Storage id -> the host bytes of the whole storage (a uint8 CPU tensor), least recently used first."""

    def __init__(self, max_tensor_bytes: int, budget_bytes: int, idle_writes: int = DEFAULT_IDLE_WRITES) -> None:
        self.lock = threading.RLock()
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        #: storage id -> derived writes to its shadow since it was last used (read here, or an input of a
        #: derivation of another storage); at ``idle_writes`` (0: never) the shadow is dropped (:meth:`written`)
        self.idle: dict[int, int] = {}
        self.idle_writes = idle_writes
        self.bytes = 0
        self.max_tensor_bytes = max_tensor_bytes
        self.budget_bytes = budget_bytes
        #: reads answered from shadows, shadows made from uploads / derived ops / fills, shadows dropped by writes
        self.counts = {"reads": 0, "uploads": 0, "derived": 0, "dropped": 0, "unread": 0}
        _C.shadow_fill_bytes(max_tensor_bytes)

    @property
    def enabled(self) -> bool:
        return self.max_tensor_bytes > 0 and self.budget_bytes > 0

    def configure(self, *, max_tensor_bytes: int | None = None, budget_bytes: int | None = None) -> None:
        """Change the bounds (``max_tensor_bytes=0`` turns shadows off); shadows over the new bounds are dropped."""
        with self.lock:
            if max_tensor_bytes is not None:
                self.max_tensor_bytes = max_tensor_bytes
            if budget_bytes is not None:
                self.budget_bytes = budget_bytes
            _C.shadow_fill_bytes(self.max_tensor_bytes if self.enabled else 0)
            for sid, host in list(self.entries.items()):
                if host.numel() > self.max_tensor_bytes:
                    self.drop(sid)
            self._evict()

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.max_tensor_bytes and self.budget_bytes > 0

    def put(self, sid: int, host: torch.Tensor) -> None:
        """Keep ``host`` (uint8, the storage's bytes, owned by the table from now on) as storage ``sid``'s shadow."""
        with self.lock:
            old = self.entries.pop(sid, None)
            if old is not None:
                self.bytes -= old.numel()
            self.entries[sid] = host
            self.bytes += host.numel()
            _C.shadow_mark(sid, True)
            self._evict()

    def get(self, sid: int) -> torch.Tensor | None:
        with self.lock:
            host = self.entries.get(sid)
            if host is not None:
                self.entries.move_to_end(sid)
            return host

    def used(self, sid: int) -> None:
        """Storage ``sid``'s shadow answered a read or fed a derivation of another storage."""
        self.idle.pop(sid, None)

    def written(self, sid: int) -> None:
        """A derived op wrote storage ``sid``'s shadow. A shadow only ever written (a batch norm's
        ``num_batches_tracked``, ``add_`` every training step, never read here) costs each write Python's path,
        a derivation on the host (60 to 220 µs of this thread, against 4 µs for the native path), and saves
        nothing: after :attr:`idle_writes` such writes in a row it is dropped, and later writes go native."""
        if not self.idle_writes:
            return
        with self.lock:
            n = self.idle.get(sid, 0) + 1
            if n < self.idle_writes:
                self.idle[sid] = n
                return
            self.drop(sid)
            self.counts["unread"] += 1

    def _remove(self, sid: int) -> torch.Tensor | None:
        """Forget storage ``sid``'s shadow here (the caller holds the lock); its bytes, or None."""
        self.idle.pop(sid, None)
        host = self.entries.pop(sid, None)
        if host is not None:
            self.bytes -= host.numel()
        return host

    def drop(self, sid: int) -> None:
        with self.lock:
            if self._remove(sid) is not None:
                self.counts["dropped"] += 1
                _C.shadow_mark(sid, False)

    def clear(self) -> None:
        """Forget every shadow (a session ends: its storages are gone)."""
        with self.lock:
            self.entries.clear()
            self.idle.clear()
            self.bytes = 0
            _C.shadow_clear()

    def reap(self) -> None:
        """Drop the bytes of shadowed storages freed since the last call."""
        freed = _C.shadow_freed()
        if freed:
            with self.lock:
                for sid in freed:
                    self._remove(sid)

    def _evict(self) -> None:
        self.reap()
        while self.bytes > self.budget_bytes and self.entries:
            sid = next(iter(self.entries))  # the least recently used
            self._remove(sid)
            _C.shadow_mark(sid, False)


#: The process's shadows (every device: storage ids are unique in the process).
TABLE = ShadowTable(_env_int("GENIE_SHADOW_MAX_BYTES", DEFAULT_MAX_TENSOR_BYTES),
                    _env_int("GENIE_SHADOW_BUDGET", DEFAULT_BUDGET_BYTES),
                    _env_int("GENIE_SHADOW_IDLE_WRITES", DEFAULT_IDLE_WRITES,
                             "a whole number of writes >= 0 (0: a shadow is never dropped for going unread)"))


def configure(*, max_tensor_bytes: int | None = None, budget_bytes: int | None = None) -> None:
    """Set the bounds of host shadows (see the module's docstring)."""
    TABLE.configure(max_tensor_bytes=max_tensor_bytes, budget_bytes=budget_bytes)


# -- reading --------------------------------------------------------------------------------------
def _remote(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.get_device() >= 0


def host_view(t: torch.Tensor) -> torch.Tensor | None:
    """A CPU tensor over ``t``'s shadow with ``t``'s dtype and layout (writes to it change the shadow), or None."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0 or not TABLE.entries:
        return None
    sid = _C.storage_id(t)
    host = TABLE.get(sid)
    if host is None:
        return None
    if host.numel() != nbytes:  # the storage grew (resize_, an out= that resized): this shadow is of the old one
        TABLE.drop(sid)
        return None
    view = torch.empty(0, dtype=t.dtype)
    view.set_(host.untyped_storage(), t.storage_offset(), tuple(t.shape), t.stride())
    if t.is_conj():
        view = view.conj()
    if t.is_neg():
        view = view._neg_view()
    return view


def read(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s values from its shadow (a new CPU tensor), or None when it has none."""
    view = host_view(t)
    if view is None:
        return None
    _answered(t)
    return view.clone().resolve_conj().resolve_neg()


def item(t: torch.Tensor) -> tuple[bool, Any]:
    """``(True, t.item())`` from the shadow, or ``(False, None)``."""
    view = host_view(t)
    if view is None or view.numel() != 1:
        return False, None
    _answered(t)
    return True, view.resolve_conj().resolve_neg().item()


def _answered(*tensors: torch.Tensor) -> None:
    for t in tensors:
        TABLE.used(_C.storage_id(t))
    TABLE.counts["reads"] += 1
    STATS.answered_locally()  # stats


#: Sync-point ops whose value the shadows can give: their host function.
_SERVER_OPS: dict[str, Callable[..., Any]] = {
    "aten::_local_scalar_dense": lambda t: t.item(),
    "aten::is_nonzero": lambda t: t.is_nonzero(),
    "aten::equal": lambda a, b: torch.equal(a, b),
}


def server_op(name: str, args: Any, kwargs: Any) -> tuple[bool, Any]:
    """``(True, value)`` of a sync-point op (``equal``, ``is_nonzero``) whose tensors all have shadows, else
    ``(False, None)``: the op goes to the server."""
    compute = _SERVER_OPS.get(name)
    if compute is None or kwargs:
        return False, None
    host: list[Any] = []
    for a in args:
        if not _remote(a):
            return False, None
        view = host_view(a)
        if view is None or view.is_complex():
            return False, None
        host.append(view.resolve_conj().resolve_neg())
    try:
        value = compute(*host)
    except (RuntimeError, ValueError):
        return False, None  # the server raises it, as before
    _answered(*args)
    return True, value


# -- making shadows -------------------------------------------------------------------------------
def _covers_storage(t: torch.Tensor) -> bool:
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def after_upload(dst: torch.Tensor, src: torch.Tensor, *, requires_grad: bool = False) -> None:
    """``dst`` (covering its storage) was given ``src``'s values (a CPU tensor of its dtype and shape)."""
    if not TABLE.enabled:
        return
    nbytes = dst.untyped_storage().nbytes()
    sid = _C.storage_id(dst)
    if requires_grad or not TABLE.fits(nbytes) or src.dtype != dst.dtype or src.is_complex():
        TABLE.drop(sid)
        return
    host = torch.empty(nbytes, dtype=torch.uint8)
    torch.empty(0, dtype=dst.dtype).set_(host.untyped_storage(), 0, tuple(dst.shape), dst.stride()).copy_(src)
    TABLE.put(sid, host)
    TABLE.counts["uploads"] += 1


def _exact_conversion(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting ``src`` values to ``dst`` gives the same bits on every kind of server."""
    if src.is_complex or dst.is_complex:
        return False
    if src == dst or not src.is_floating_point:
        return True  # integer and bool sources convert with one rounding rule (to nearest even) everywhere
    if not dst.is_floating_point:
        return False  # float -> integer of an out-of-range value or NaN is undefined
    return torch.finfo(dst).bits > torch.finfo(src).bits and not (src == torch.bfloat16 and dst == torch.float16)


def after_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` was queued (``src`` remote, or a CPU tensor sent inline): keep ``dst``'s shadow true."""
    if not TABLE.entries and not TABLE.enabled:
        return
    with TABLE.lock:
        values = src if not _remote(src) else host_view(src)
        target = host_view(dst)
        sid = _C.storage_id(dst)
        if values is None or not _exact_conversion(values.dtype, dst.dtype):
            TABLE.drop(sid)
            return
        try:
            if target is None:
                nbytes = dst.untyped_storage().nbytes()
                if not (_covers_storage(dst) and TABLE.fits(nbytes)):
                    return
                host = torch.empty(nbytes, dtype=torch.uint8)
                torch.empty(0, dtype=dst.dtype).set_(host.untyped_storage(), 0, tuple(dst.shape),
                                                     dst.stride()).copy_(values)
                TABLE.put(sid, host)
                TABLE.counts["derived"] += 1
            else:
                target.copy_(values)
        except RuntimeError:
            TABLE.drop(sid)


def forget_tensors(tensors: Iterable[Any]) -> None:
    """Drop the shadows of these tensors' storages (a command that may write them, not described by a schema)."""
    if not TABLE.entries:
        return
    for t in tensors:
        if isinstance(t, (list, tuple)):
            forget_tensors(t)
        elif _remote(t) and t.untyped_storage().nbytes():
            TABLE.drop(_C.storage_id(t))


# -- ops ------------------------------------------------------------------------------------------
#: Ops (every overload, ``out=`` forms too) whose result moves, selects, compares or tests values: exact in
#: every dtype but complex.
MOVE_OPS = frozenset(f"aten::{n}" for n in """
    index index_select gather cat stack clone where masked_fill masked_fill_ flip roll repeat tril triu
    constant_pad_nd eq ne lt le gt ge eq_ ne_ lt_ le_ gt_ ge_ isin any all logical_not logical_and logical_or
    logical_xor isnan isinf isfinite signbit fill_ zero_ index_put index_put_ _index_put_impl_ scatter scatter_
    slice_scatter select_scatter masked_scatter masked_scatter_ copy copy_ _to_copy
""".split())
#: Integer arithmetic and reductions: exact on integer and bool tensors with integer numbers only.
INT_OPS = frozenset(f"aten::{n}" for n in """
    add add_ sub sub_ rsub mul mul_ neg neg_ abs abs_ bitwise_not bitwise_not_ bitwise_and bitwise_and_ bitwise_or
    bitwise_or_ bitwise_xor bitwise_xor_ cumsum cumsum_ cumprod sum prod max min amax amin maximum minimum clamp
    clamp_ clamp_min clamp_max argmax argmin sign
""".split())
#: Ops that overwrite all of their first argument whatever it held: a shadow from nothing.
FILL_OPS = frozenset({"aten::fill_", "aten::zero_"})
#: Arguments that turn a moving op into arithmetic (``index_put_(accumulate=True)``, ``scatter(reduce=...)``).
_ARITHMETIC_ARGS = ("accumulate", "reduce")


#: Sync points and copies the shadows answer or follow: genie._C sends calls of these with a shadowed tensor
#: to Python too.
_FOLLOWED = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::copy_",
                       "aten::_copy_from", "aten::_copy_from_and_resize"})
# genie._C's native path sends Python a call of these only when it writes a shadowed storage or Python can
# derive it (every tensor it reads shadowed, dtypes and numbers as _derive takes them); a followed op with any
# shadowed tensor (genie/csrc/device/fastpath.cpp, touches_shadow).
_C.shadow_ops(sorted(_FOLLOWED), sorted((MOVE_OPS | FILL_OPS) - _FOLLOWED), sorted(INT_OPS))


class Rule:
    """What the shadows need to know about an op: the arguments it writes, those whose old values do not matter
    (``out=``, a fill's target), and how it may be derived (``"move"``, ``"int"`` or None)."""

    __slots__ = ("writes", "overwrites", "kind", "fills", "arithmetic")

    def __init__(self, writes: tuple[tuple[int, str], ...], kind: str | None, fills: bool,
                 overwrites: tuple[tuple[int, str], ...] = (), arithmetic: tuple[tuple[int, str], ...] = ()) -> None:
        self.writes = writes
        self.overwrites = overwrites
        self.kind = kind
        self.fills = fills
        self.arithmetic = arithmetic


#: Arguments ops write although their schema does not mark them (``Tensor?`` with no ``(a!)``): batch norm
#: updates its running statistics in place in training (``F.batch_norm`` reaches ``native_batch_norm``).
UNMARKED_WRITES: dict[str, tuple[str, ...]] = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
    "aten::cudnn_batch_norm": ("running_mean", "running_var"),
    "aten::miopen_batch_norm": ("running_mean", "running_var"),
}


def rule_of(func: Any) -> Rule | None:
    """The op's :class:`Rule`, or None when it neither writes an argument nor can be derived."""
    schema = func._schema
    packet = schema.name
    arguments = schema.arguments
    writes = tuple((i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)
    writes += tuple((i, a.name) for i, a in enumerate(arguments) if a.name in UNMARKED_WRITES.get(packet, ()))
    kind = "move" if packet in MOVE_OPS else "int" if packet in INT_OPS else None
    overwrites = tuple((i, a.name) for i, a in enumerate(arguments)
                       if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    if packet in FILL_OPS:
        overwrites = writes[:1]
    arithmetic = tuple((i, a.name) for i, a in enumerate(arguments) if a.name in _ARITHMETIC_ARGS)
    if not writes and kind is None:
        return None
    return Rule(writes, kind, bool(overwrites), overwrites, arithmetic)


def _flat_tensors(values: Iterable[Any], into: list[torch.Tensor]) -> list[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            into.append(v)
        elif isinstance(v, (list, tuple)):
            _flat_tensors(v, into)
    return into


def _numbers_ok(values: Iterable[Any], kind: str) -> bool:
    for v in values:
        if isinstance(v, (list, tuple)):
            if not _numbers_ok(v, kind):
                return False
        elif isinstance(v, complex) or (kind == "int" and isinstance(v, float)):
            return False
    return True


def _dtype_ok(t: torch.Tensor, kind: str) -> bool:
    if t.is_complex():
        return False
    return kind != "int" or not t.is_floating_point()


def _written(rule: Rule, args: Any, kwargs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for pos, name in rule.writes:
        value = args[pos] if pos < len(args) else kwargs.get(name)
        _flat_tensors([value], out)
    return [t for t in out if _remote(t)]


def after_op(func: Any, rule: Rule, args: Any, kwargs: Any, outs: list[Any]) -> None:
    """An op was queued with these arguments and outputs: drop the shadows it may write, derive the ones it can."""
    with TABLE.lock:
        written = _written(rule, args, kwargs)
        if rule.kind is None or not _derive(func, rule, args, kwargs, outs, written):
            for t in written:
                if t.untyped_storage().nbytes():
                    TABLE.drop(_C.storage_id(t))


def _arg(args: Any, kwargs: Any, pos: int, name: str) -> Any:
    return args[pos] if pos < len(args) else kwargs.get(name)


def _derive(func: Any, rule: Rule, args: Any, kwargs: Any, outs: list[Any], written: list[torch.Tensor]) -> bool:
    """Run the op on the inputs' shadows too; False (nothing changed) when it cannot be."""
    kind = rule.kind
    assert kind is not None
    if any(_arg(args, kwargs, pos, name) not in (None, False) for pos, name in rule.arithmetic):
        kind = "int"  # index_put_(accumulate=True), scatter(reduce=...): arithmetic, exact on integers only
    if not _numbers_ok(args, kind) or not _numbers_ok(kwargs.values(), kind):
        return False
    inputs = _flat_tensors(args, _flat_tensors(kwargs.values(), []))
    for t in [*inputs, *(o for o in outs if isinstance(o, torch.Tensor))]:
        if not _dtype_ok(t, kind):
            return False
    views: dict[int, torch.Tensor] = {}
    made: dict[int, tuple[int, torch.Tensor]] = {}  # id(remote tensor) -> (storage id, new host bytes)
    overwritten = [t for pos, name in rule.overwrites for t in _flat_tensors([_arg(args, kwargs, pos, name)], [])
                   if _remote(t)]
    # ``x.add_(2)`` arrives as ``add.out(x, 2, out=x)``: a target that is also read keeps its old values
    out_positions = {pos for pos, _ in rule.overwrites}
    out_names = {name for _, name in rule.overwrites}
    read = _flat_tensors([a for i, a in enumerate(args) if i not in out_positions], [])
    read = _flat_tensors([v for k, v in kwargs.items() if k not in out_names], read)
    read_sids = {_C.storage_id(t) for t in read if _remote(t) and t.untyped_storage().nbytes()}
    # Targets whose old values do not matter (out=, a fill): their shadow, or a new one when they cover a
    # small storage (a fresh storage is zeroed on the server too).
    for t in overwritten:
        view = host_view(t)
        if view is None:
            nbytes = t.untyped_storage().nbytes()
            if not (TABLE.enabled and _covers_storage(t) and TABLE.fits(nbytes)) or _C.storage_id(t) in read_sids:
                return False
            if rule.fills and (t.is_floating_point() or t.is_complex()):
                return False  # float fills build attention masks in every forward; kept native (fastpath.cpp)
            host = torch.zeros(nbytes, dtype=torch.uint8)
            view = torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), 0, tuple(t.shape), t.stride())
            made[id(t)] = (_C.storage_id(t), host)
        views[id(t)] = view
    for t in inputs:
        if not _remote(t) or id(t) in views:
            continue
        view = host_view(t)
        if view is None:
            return False
        views[id(t)] = view
    fresh: list[torch.Tensor] = []
    for o in outs:
        if _remote(o) and id(o) not in views:
            if not TABLE.fits(o.untyped_storage().nbytes()):
                return False
            fresh.append(o)

    def host_arg(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return views.get(id(a), a)
        if isinstance(a, list):
            return [host_arg(x) for x in a]
        if isinstance(a, tuple):
            return tuple(host_arg(x) for x in a)
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    # One thread: these tensors are small, and some CPU kernels (tril, triu) fork a parallel region whatever
    # the size; waking the pool cost 20 to 70 ms per call on a loaded 2-core machine (GPT-2's causal mask).
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        result = func(*host_arg(list(args)), **{k: host_arg(v) for k, v in kwargs.items()})
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False  # the server decides (and reports) what the op does with these values
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
    results = _flat_tensors([result], [])
    remote_outs = [o for o in outs if isinstance(o, torch.Tensor)]
    if len(results) != len(remote_outs):
        return False
    for o, r in zip(remote_outs, results, strict=True):
        if o.dtype != r.dtype or tuple(o.shape) != tuple(r.shape):
            return False  # meta and the CPU kernel disagree: trust neither here
        if any(o is f for f in fresh):
            host = torch.zeros(o.untyped_storage().nbytes(), dtype=torch.uint8)  # zeroed on the server too
            torch.empty(0, dtype=o.dtype).set_(host.untyped_storage(), o.storage_offset(), tuple(o.shape),
                                               o.stride()).copy_(r)
            made[id(o)] = (_C.storage_id(o), host)
        elif id(o) in views and r.data_ptr() != views[id(o)].data_ptr():
            views[id(o)].copy_(r)  # an in-place/out= result the CPU kernel put elsewhere (it resized)
    for sid, host in made.values():
        TABLE.put(sid, host)
        TABLE.counts["derived"] += 1
    written_sids = {_C.storage_id(t) for t in written if t.untyped_storage().nbytes()}  # overwritten among them
    for sid in read_sids - written_sids:
        TABLE.used(sid)
    for sid in written_sids:
        TABLE.written(sid)
    return True
