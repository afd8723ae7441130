"""The completeness gates beside OpInfo (gates.py), one pytest item per case, judged as OpInfo's are
(tests/device/opinfo/expected_failures.toml for known failures, tests/device/deny_list.toml for refusals)."""

from __future__ import annotations

from typing import Any

from opinfo_cases import Case


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
