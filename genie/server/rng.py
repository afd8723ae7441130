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

Swapping the session's state into the device's default generator around the
kernel was not chosen: the CPU flash kernel refuses ``dropout_p > 0`` (torch
2.13: so ``_scaled_dot_product_flash_attention_for_cpu`` draws nothing and is
not listed here; tests/device/test_attention_dropout.py pins the refusal, and
fails when a torch accepts it), the CUDA kernels' philox seed and offset would
have to travel to the backward, and a process-wide default generator is shared
by every thread of the process (sessions are threads under ``--isolation none``).

The fused attention op draws only when ``dropout_p`` is not 0
(:data:`DRAWS_ONLY_WITH_DROPOUT`, :func:`draws`): graphs holding it with
``dropout_p`` 0 still compile or become CUDA graphs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from genie.errors import QuotaExceededError
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


#: Random ops without a generator argument, by name, and how to run them with the session's generator.
GENERATORLESS: dict[str, Callable[[torch.Generator, list[Any], dict[str, Any]], Any]] = {
    "aten::native_dropout": _native_dropout,
    _FUSED_ATTENTION: _fused_attention,
}
GENERATORLESS.update({f"{name}.default": run for name, run in list(GENERATORLESS.items())})

#: Ops of GENERATORLESS that draw only when their ``dropout_p`` is not 0.
DRAWS_ONLY_WITH_DROPOUT = frozenset({_FUSED_ATTENTION, f"{_FUSED_ATTENTION}.default"})


def draws(label: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether the generatorless op ``label`` called with these arguments draws random numbers (False for an op
    not in GENERATORLESS; a ``dropout_p`` that is not a plain number counts as drawing)."""
    if label not in GENERATORLESS:
        return False
    if label not in DRAWS_ONLY_WITH_DROPOUT:
        return True
    p = _dropout_p(args, kwargs)
    return not (type(p) in (int, float) and p == 0)


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
