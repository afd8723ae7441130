"""The completeness gates: PyTorch's OpInfo database and the four beside it (gates.py), run on remote_accelerator
against a real genie server and compared with CPU, one pytest item per case (op, variant, dtype, kind).

See conftest.py for the sweeps and options and docs/device-testing.md for how to read and regenerate the
expected-failure list (tests/device/opinfo/expected_failures.toml; tests/device/deny_list.toml for refusals).
One file: the sweep is one per session (one worker process, one server, one report), and ``scripts/test``
hands whole files to its workers.
"""

from __future__ import annotations

from typing import Any

from opinfo_cases import Case


def test_op_matches_cpu(opinfo_case: Case, opinfo_sweep: Any) -> None:
    """The op's outputs (forward) or gradients (backward) on the device equal CPU's within 1e-3."""
    opinfo_sweep.judge(opinfo_case)


def test_module_matches_cpu(module_case: Case, opinfo_sweep: Any) -> None:
    """A ModuleInfo module's outputs (forward) or parameter and input gradients (backward), in train or
    eval mode, equal CPU's within 1e-3."""
    opinfo_sweep.judge(module_case)


def test_optimizer_steps_match_cpu(optim_case: Case, opinfo_sweep: Any) -> None:
    """Three steps of every optim_db configuration (plain, foreach or fused) leave the parameters CPU's do."""
    opinfo_sweep.judge(optim_case)


def test_random_op_runs_and_matches_cpu(random_case: Case, opinfo_sweep: Any) -> None:
    """A random op runs (is not refused), with and without a torch.Generator; on a CPU server its draws
    equal CPU's for the same seed, elsewhere their range and mean are right."""
    opinfo_sweep.judge(random_case)


def test_amp_steps_match_cpu(amp_case: Case, opinfo_sweep: Any) -> None:
    """Three autocast + GradScaler steps (float16, bfloat16) track CPU's: same scale, losses and weights
    within 2e-2."""
    opinfo_sweep.judge(amp_case)
