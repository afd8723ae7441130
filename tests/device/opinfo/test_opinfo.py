"""PyTorch's OpInfo database run on remote_accelerator against a real genie server, compared with CPU.

Each item is one (op, variant, dtype, kind); see conftest.py for the sweeps and options and
docs/device-testing.md for how to read and regenerate the expected-failure list.
"""

from __future__ import annotations

from typing import Any

import pytest
from opinfo_cases import Case


def test_op_matches_cpu(opinfo_case: Case, opinfo_sweep: Any) -> None:
    """The op's outputs (forward) or gradients (backward) on the device equal CPU's within 1e-3."""
    result = opinfo_sweep.pool.run(opinfo_case, opinfo_sweep.timeout)
    opinfo_sweep.results[opinfo_case] = result
    listed = opinfo_sweep.expected.get(opinfo_case.key)
    status, reason = result["status"], result.get("reason", "")
    if status == "skip":
        pytest.skip(reason)
    if opinfo_sweep.update:
        if status == "fail":
            pytest.xfail(f"recorded in the expected list: {reason}")
        return
    if status == "pass" and listed is not None:
        pytest.fail(f"{opinfo_case.test_id} passes but expected_failures.toml lists it ({listed!r}): the list is "
                    "stale; remove the entry or regenerate the list with --update-expected")
    if status == "fail":
        if listed is not None:
            pytest.xfail(listed)
        pytest.fail(f"{opinfo_case.test_id} differs from CPU: {reason}\n(a new failure: fix the device, or list it "
                    "in tests/device/opinfo/expected_failures.toml with the reason)")
