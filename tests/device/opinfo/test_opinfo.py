"""PyTorch's OpInfo database run on remote_accelerator against a real genie server, compared with CPU.

Each item is one (op, variant, dtype, kind); see conftest.py for the sweeps and options and
docs/device-testing.md for how to read and regenerate the expected-failure list.
"""

from __future__ import annotations

from typing import Any

from opinfo_cases import Case


def test_op_matches_cpu(opinfo_case: Case, opinfo_sweep: Any) -> None:
    """The op's outputs (forward) or gradients (backward) on the device equal CPU's within 1e-3."""
    opinfo_sweep.judge(opinfo_case)
