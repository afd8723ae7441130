"""What one OpInfo case is, how it is named, and which cases each sweep runs.

A case is one (op, variant, dtype, kind): ``kind`` is ``forward`` (the op's outputs on the remote
device compared with CPU) or ``backward`` (its gradients compared with CPU's). This module imports
no torch internals, so the pytest process can use it without importing ``op_db`` (whose import
changes global torch state; the worker process owns that).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import attrs

#: The dtypes forward cases run in (issue 10's correctness bar), in report order.
FORWARD_DTYPES = ("float32", "float16", "bfloat16", "int64", "bool", "complex64")
#: Gradients are compared in float32 only.
BACKWARD_DTYPES = ("float32",)
#: forward/backward: OpInfo and ModuleInfo; step: optimizers and AMP; draw: random ops (gates.py).
KINDS = ("forward", "backward", "step", "draw")
#: Each gate's cases are named "<gate>:<name>" (OpInfo's are plain op names), in report order.
GATES = ("opinfo", "module", "optim", "random", "amp")
#: The CI subset's stride per gate: every N-th (op or module or optimizer, variant); 1 runs them all.
GATE_STRIDES = {"opinfo": 12, "module": 8, "optim": 1, "random": 1, "amp": 1}
#: Dtypes the CI subset runs in per gate (all when absent): float64 module cases run in the full sweep.
GATE_CI_DTYPES = {"module": ("float32",)}
#: The CI subset takes every CI_STRIDE-th op (sorted by name and variant), all of its dtypes and kinds.
CI_STRIDE = 12
#: The op name of the worker's self-test cases (a hang, an abort, a device probe), never an OpInfo.
SELFTEST = "genie.selftest"
#: ``GENIE_OPINFO``: ``ci`` (default, the subset) or ``full`` (every op).
MODES = ("ci", "full")


@attrs.frozen(order=True)
class Case:
    """One comparison: ``op`` (OpInfo name), ``variant`` (its variant_test_name, "" for none), dtype, kind."""

    op: str
    variant: str
    dtype: str
    kind: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.op, self.variant, self.dtype, self.kind)

    @property
    def gate(self) -> str:
        """``opinfo`` or the prefix of ``op`` (``module``, ``optim``, ``random``, ``amp``)."""
        return self.op.split(":", 1)[0] if ":" in self.op and not self.op.startswith("genie.") else "opinfo"

    @property
    def op_id(self) -> str:
        """``op`` or ``op.variant``: how PyTorch names the OpInfo in test ids."""
        return f"{self.op}.{self.variant}" if self.variant else self.op

    @property
    def test_id(self) -> str:
        return f"{self.op_id}-{self.dtype}-{self.kind}"

    def to_json(self) -> dict[str, str]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, str]) -> Case:
        return cls(op=data["op"], variant=data["variant"], dtype=data["dtype"], kind=data["kind"])


def server_devices(environ: dict[str, str] | None = None) -> str:
    """The sweep server's ``--devices``: ``GENIE_OPINFO_SERVER_DEVICES`` (``cuda:0`` on a GPU host) or ``cpu``."""
    return (os.environ if environ is None else environ).get("GENIE_OPINFO_SERVER_DEVICES", "cpu").strip() or "cpu"


def mode_from_env(environ: dict[str, str] | None = None) -> str:
    """The sweep ``GENIE_OPINFO`` asks for; a clear error for anything but ``ci`` / ``full``."""
    mode = (os.environ if environ is None else environ).get("GENIE_OPINFO", "ci").strip().lower() or "ci"
    if mode not in MODES:
        raise ValueError(f"GENIE_OPINFO={mode!r} is not a sweep; use one of {', '.join(MODES)}")
    return mode


def select(cases: Iterable[Case], mode: str, stride: int | None = None) -> list[Case]:
    """The cases ``mode`` runs, sorted. ``ci``: per gate, every N-th op (by op and variant, a fixed,
    deterministic choice that does not depend on the machine; N is ``stride`` or the gate's
    ``GATE_STRIDES``), with all of its dtypes (``GATE_CI_DTYPES`` narrows a gate's) and kinds."""
    ordered = sorted(set(cases))
    if mode == "full":
        return ordered
    chosen: set[tuple[str, str]] = set()
    for gate in {c.gate for c in ordered}:
        ops = sorted({(c.op, c.variant) for c in ordered if c.gate == gate})
        chosen.update(ops[::stride or GATE_STRIDES.get(gate, CI_STRIDE)])
    return [c for c in ordered if (c.op, c.variant) in chosen and c.dtype in GATE_CI_DTYPES.get(c.gate, (c.dtype,))]


def coverage(cases: Sequence[Case]) -> set[tuple[str, str]]:
    """The (kind, dtype) groups that ``cases`` cover."""
    return {(c.kind, c.dtype) for c in cases}
