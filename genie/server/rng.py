"""Per-session random streams: sessions never share, or move, each other's generator.

Each session has its own ``torch.Generator`` per (device index, generator id);
id 0 is the session's default generator of that device. Every generator starts
seeded from ``os.urandom`` and is reseeded by ``CMD_SEED``. A random op whose
``generator`` argument is None gets the session's default generator of the
command's device, so no op of a session ever draws from the process-global
generator another session would also use.

A few random ops take no generator argument at all; they are run here by an
equivalent built on ops that do (:data:`GENERATORLESS`), keyed by the op's name
with and without ``.default`` (a client may spell either):

- ``aten::native_dropout``: a Bernoulli(1 - p) keep mask drawn with the
  session's generator, the CPU kernel's arithmetic (the same numbers as a local
  CPU run with the same seed).
- ``aten::_scaled_dot_product_fused_attention_overrideable`` (fused attention,
  what a client sends for a CUDA server): with ``dropout_p`` 0 it draws nothing
  and runs its kernel; with ``dropout_p > 0``, on any device, it runs
  :func:`genie.server.sdpa.attention_with_dropout`: attention's math path
  (softmax, then the keep mask scaled by 1 / (1 - p): the distribution the flash
  and memory-efficient kernels draw, which apply dropout to the same weights),
  its mask from a generator seeded with one 62-bit draw from the session's
  generator. That seed is the op's ``philox_seed`` output, so the backward
  rebuilds the forward's mask and draws nothing. Numbers equal to a local CUDA
  kernel's are not promised (nor are they between CUDA kernels).
- The composites a client may name although the genie client decomposes them
  (a raw client, a compiled graph): the dropout family (``dropout``,
  ``feature_dropout``, ``alpha_dropout``, ``feature_alpha_dropout`` and their
  in-place twins), ``native_dropout.out``, and ``rand``, ``randn``, ``randint``,
  ``randperm`` and their ``_like`` forms, every overload without a generator
  argument. Each runs its own kernel under :class:`_SessionDraws`, a dispatch mode
  that hands the session's generator to every draw below it (``bernoulli_``,
  ``uniform_``, ``rand.generator``; ``native_dropout`` by its equivalent above):
  the kernel's distribution, and on CPU a local run's numbers seeded alike. With
  ``train`` False or ``p`` 0 the kernel draws nothing. An op below that would
  still draw from the process's generator is refused (ForbiddenOpError).
- ``aten::scaled_dot_product_attention``: with ``dropout_p`` 0 its kernel as is;
  else its math path (the one a CPU run takes with dropout; on CUDA the composite
  would pick a fused kernel that draws from the process's generator) under
  :class:`_SessionDraws`, a boolean mask turned additive as the composite does.

Swapping the session's state into the device's default generator around the
kernel was not chosen: the CPU flash kernel refuses ``dropout_p > 0`` (torch
2.13: so ``_scaled_dot_product_flash_attention_for_cpu`` draws nothing and is
not listed here; tests/device/test_attention_dropout.py pins the refusal, and
fails when a torch accepts it), the CUDA kernels' philox seed and offset would
have to travel to the backward, and a process-wide default generator is shared
by every thread of the process (sessions are threads under ``--isolation none``).

The attention ops draw only when ``dropout_p`` is not 0
(:data:`DRAWS_ONLY_WITH_DROPOUT`, :func:`draws`): graphs holding it with
``dropout_p`` 0 still compile or become CUDA graphs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genie.errors import ForbiddenOpError, QuotaExceededError
from genie.server import sdpa

#: Most generators one session may create (all devices together).
MAX_GENERATORS = 4096

_NO_GENERATOR = (-1, "")
#: id(op) -> (index of its generator argument, its name), or _NO_GENERATOR. Keyed by id: OpOverloads are
#: process-lifetime singletons, and an int hashes faster than an OpOverload on this per-op path.
_generator_args: dict[int, tuple[int, str]] = {}


def generator_arg(op: torch._ops.OpOverload) -> tuple[int, str]:
    """(position of ``op``'s Generator argument, -1 when keyword-only; its name), or (-1, "") without one."""
    found = _generator_args.get(id(op))
    if found is None:
        found = _NO_GENERATOR
        for i, arg in enumerate(op._schema.arguments):
            if "Generator" in str(arg.type):
                found = (-1 if arg.kwarg_only else i, arg.name)
                break
        _generator_args[id(op)] = found
    return found


def _native_dropout(g: torch.Generator, args: list[Any], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::native_dropout(input, p, train)`` drawing from ``g`` (same arithmetic as the CPU kernel)."""
    values = dict(zip(("input", "p", "train"), args, strict=False)) | kwargs
    x, p, train = values["input"], float(values["p"]), values.get("train")
    if x.numel() == 0:
        return x.clone(), torch.empty_like(x, dtype=torch.bool)
    if train is None or train:
        keep = 1.0 - p
        mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(keep, generator=g)
        return x * mask * (0.0 if keep == 0 else 1.0 / keep), mask
    return x.clone(), torch.ones_like(x, dtype=torch.bool)


_ATTENTION_ARGS = ("query", "key", "value", "attn_bias", "dropout_p", "is_causal", "return_debug_mask")
_FUSED_ATTENTION = "aten::_scaled_dot_product_fused_attention_overrideable"


def _fused_attention(g: torch.Generator, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The overrideable SDPA op; with ``dropout_p > 0`` drawing from ``g`` (genie.server.sdpa)."""
    if _dropout_p(args, kwargs) == 0:
        return torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default(*args, **kwargs)
    values = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
    return sdpa.attention_with_dropout(g, **values)


def _dropout_p(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The fused attention op's ``dropout_p`` (position 4, default 0)."""
    return args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)


_Runner = Callable[[torch.Generator, list[Any], dict[str, Any]], Any]

#: The hand-written equivalents, by the name ``OpOverload.name()`` gives (what :class:`_SessionDraws` sees).
_WRITTEN: dict[str, _Runner] = {
    "aten::native_dropout": _native_dropout,
    _FUSED_ATTENTION: _fused_attention,
}


class _SessionDraws(TorchDispatchMode):
    """Runs every op below it with the session's generator ``g`` wherever the op would draw random numbers.

    It sees the ops a composite kernel calls (the dropout family's ``bernoulli_``, ``rand``'s ``uniform_``):
    a None or missing generator argument becomes ``g``; an op of :data:`_WRITTEN` runs its equivalent; an op
    tagged ``nondeterministic_seeded`` without a generator argument runs its CompositeExplicitAutograd kernel
    under a fresh mode (``aten::rand`` calls ``rand.generator`` with None); anything else that would draw
    from the process's generator is refused (a CUDA attention kernel with dropout, for one).
    """

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.g = g

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = list(args), dict(kwargs or {})
        index, name = generator_arg(func)
        if name:
            if 0 <= index < len(args):
                if args[index] is None:
                    args[index] = self.g
            elif kwargs.get(name) is None:
                kwargs[name] = self.g
            return func(*args, **kwargs)
        written = _WRITTEN.get(func.name())
        if written is not None:
            return written(self.g, args, kwargs)
        if torch.Tag.nondeterministic_seeded not in func.tags or not draws_with(func, args, kwargs):
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeExplicitAutograd"):
            with _SessionDraws(self.g):
                return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        raise ForbiddenOpError(
            f"op {func.name()!r} would draw from the server process's shared generator, not the session's: "
            "genie servers refuse it; send the op's decomposition (what the genie client sends) instead")


def draws_with(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a ``nondeterministic_seeded`` op draws with these arguments: not with a ``dropout_p`` of 0 (attention
    without dropout draws nothing: the CPU flash kernel and the fused-attention op carry the tag for their dropout
    alone)."""
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    p = names.index("dropout_p")
    value = args[p] if p < len(args) else kwargs.get("dropout_p", func._schema.arguments[p].default_value)
    return not (type(value) in (int, float) and value == 0)


def _under_session(op: torch._ops.OpOverload) -> _Runner:
    """Run ``op`` itself (its composite kernel: the same distribution, on CPU the same numbers as a local run
    seeded alike) with every draw below it from the session's generator (:class:`_SessionDraws`)."""
    def run(g: torch.Generator, args: list[Any], kwargs: dict[str, Any]) -> Any:
        with _SessionDraws(g):
            return op(*args, **kwargs)
    return run


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _sdpa(g: torch.Generator, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``aten::scaled_dot_product_attention``: with ``dropout_p`` 0 its kernel as is; else its math path (the path
    a CPU run takes with dropout; a CUDA run would pick a fused kernel that draws from the process's generator),
    its dropout from ``g``."""
    values = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
    if _dropout_p(args, kwargs) == 0:
        return torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs)
    query = values.pop("query")
    mask = values.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # what the composite does before its math path
        values["attn_mask"] = torch.where(mask, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                                          torch.scalar_tensor(-float("inf"), dtype=query.dtype, device=query.device))
    with _SessionDraws(g):
        return torch.ops.aten._scaled_dot_product_attention_math.default(
            query, values.pop("key"), values.pop("value"), **values)[0]


#: Packets whose overloads without a generator argument draw from the process's generator when run as they are:
#: composites whose draws :func:`_under_session` hands the session's generator. A client that decomposes them
#: (the genie client does) never sends them; a raw client or a compiled graph may name them.
_DRAWN_UNDER_SESSION = (
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout",
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
)


def _generatorless_table() -> dict[str, _Runner]:
    table: dict[str, _Runner] = dict(_WRITTEN)
    table["aten::scaled_dot_product_attention"] = _sdpa
    for packet_name in _DRAWN_UNDER_SESSION:
        packet = getattr(torch.ops.aten, packet_name)  # names of this module's own tuple, never a client's
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if generator_arg(op)[1] or torch.Tag.nondeterministic_seeded not in op.tags:
                continue
            table.setdefault(op.name(), _under_session(op))
    # A default overload's name has no suffix; a client may spell it with ".default" too.
    table.update({f"{name}.default": run for name, run in list(table.items()) if "." not in name})
    return table


#: Random ops without a generator argument, by the name a client sends, and how to run them with the session's
#: generator.
GENERATORLESS: dict[str, _Runner] = _generatorless_table()

#: Ops of GENERATORLESS that draw only when their ``dropout_p`` is not 0.
DRAWS_ONLY_WITH_DROPOUT = frozenset({_FUSED_ATTENTION, f"{_FUSED_ATTENTION}.default",
                                     "aten::scaled_dot_product_attention", "aten::scaled_dot_product_attention.default"})


def draws(label: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether the generatorless op ``label`` called with these arguments draws random numbers (False for an op
    not in GENERATORLESS; a ``dropout_p`` that is not a plain number counts as drawing)."""
    if label not in GENERATORLESS:
        return False
    if label not in DRAWS_ONLY_WITH_DROPOUT:
        return True
    p = _dropout_p(args, kwargs)
    return not (type(p) in (int, float) and p == 0)


def node_draws(op: torch._ops.OpOverload, label: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a graph node (``op``, named ``label``, called with ``args``/``kwargs``) may draw random numbers: a
    generatorless random op (:func:`draws`), an op with a generator argument, or an op tagged
    ``nondeterministic_seeded`` unless its ``dropout_p`` is the constant 0 (:func:`draws_with`). The one rule that
    keeps such a node out of what freezes a seed: a CUDA graph (genie.server.cuda_graphs) and an inductor
    compile (genie.server.inductor_replays)."""
    if draws(label, args, kwargs) or generator_arg(op)[1]:
        return True
    return torch.Tag.nondeterministic_seeded in op.tags and draws_with(op, args, kwargs)


def draws_outside_session(op: torch._ops.OpOverload, label: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a graph node may draw random numbers from a generator that is not one of the session's: it draws
    (:func:`node_draws`) yet neither takes a generator argument (which the session's fill) nor runs by a
    session-bound runner (:data:`GENERATORLESS`); an op tagged ``nondeterministic_seeded`` that draws from the
    process's generator. A CUDA graph registers the session's generators with its capture and keeps such a node
    out (genie.server.cuda_graphs)."""
    if label in GENERATORLESS or generator_arg(op)[1]:
        return False
    return node_draws(op, label, args, kwargs)


class SessionGenerators:
    """The generators of one session, by (device index, generator id)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self._generators: dict[tuple[int, int], torch.Generator] = {}

    def get(self, device_index: int, generator_id: int) -> torch.Generator:
        """The generator, made and seeded from ``os.urandom`` on first use."""
        key = (device_index, generator_id)
        g = self._generators.get(key)
        if g is None:
            if len(self._generators) >= MAX_GENERATORS:
                raise QuotaExceededError(
                    f"session generator limit reached: {MAX_GENERATORS} generators; reuse torch.Generator objects")
            g = torch.Generator(device=self.devices[device_index])
            g.manual_seed(int.from_bytes(os.urandom(8), "little"))
            self._generators[key] = g
        return g

    def on_device(self, device_index: int) -> list[torch.Generator]:
        """The session's generators of device ``device_index`` made so far."""
        return [g for (index, _), g in self._generators.items() if index == device_index]

    def seed(self, device_index: int, generator_id: int, seed: int) -> None:
        """Reseed one generator (``CMD_SEED``)."""
        self.get(device_index, generator_id).manual_seed(seed)

    def fill_default(self, op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any],
                     device_index: int) -> None:
        """Give ``op`` the session's default generator where its ``generator`` argument is None or left out."""
        index, name = generator_arg(op)
        if not name:
            return
        if 0 <= index < len(args):
            if args[index] is None:
                args[index] = self.get(device_index, 0)
        elif kwargs.get(name) is None:
            kwargs[name] = self.get(device_index, 0)

    def generatorless(self, name: str, device_index: int) -> Callable[[list[Any], dict[str, Any]], Any] | None:
        """A runner for a random op that has no generator argument, bound to the session's default; else None."""
        run = GENERATORLESS.get(name)
        if run is None:
            return None
        g = self.get(device_index, 0)
        return lambda args, kwargs: run(g, args, kwargs)
