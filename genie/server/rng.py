"""Per-session random streams: sessions never share, or move, each other's generator.

Each session has its own ``torch.Generator`` per (device index, generator id);
id 0 is the session's default generator of that device. Every generator starts
seeded from ``os.urandom`` and is reseeded by ``CMD_SEED``. A random op whose
``generator`` argument is None gets the session's default generator of the
command's device, so no op of a session ever draws from the process-global
generator another session would also use.

A few random ops take no generator argument at all (``aten::native_dropout``);
they are run here by an equivalent built on ops that do (:data:`GENERATORLESS`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from genie.errors import QuotaExceededError

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


#: Random ops without a generator argument, by name, and how to run them with the session's generator.
GENERATORLESS: dict[str, Callable[[torch.Generator, list[Any], dict[str, Any]], Any]] = {
    "aten::native_dropout": _native_dropout,
}


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
