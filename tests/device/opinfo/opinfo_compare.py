"""Run one OpInfo case on the remote device and compare it with CPU, as PyTorch's ``test_compare_cpu`` does.

Only the public device API is used: samples are made on CPU, moved with ``.to(device)``, the op runs
there, results come back with ``.cpu()``. Tolerances are ``test_compare_cpu``'s (atol = rtol = 1e-3,
through PyTorch's own ``TestCase.assertEqual``). Imported by the worker process only: importing
``op_db`` changes global torch state (``torch.backends.disable_global_flags``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import attrs
import deny_list
import torch
from torch.testing._internal.common_utils import TestCase
from torch.utils._pytree import tree_leaves, tree_map

#: test_compare_cpu's tolerances.
ATOL = RTOL = 1e-3
#: Per-case seed: sample inputs (made on CPU) are the same in every run and on every machine.
SEED = 20261123


class _Asserter(TestCase):
    """PyTorch's TestCase, only for its assertEqual (the comparison test_compare_cpu uses)."""

    def runTest(self) -> None:  # unittest wants a test method to exist
        pass


@attrs.frozen
class Outcome:
    """``status`` is pass, fail, skip or denied (every sample refused by a listed op); ``reason`` says
    why (for fail: the error's first line)."""

    status: str
    reason: str = ""
    samples: int = 0
    #: the deny-list entries (refused ops) whose samples were left out
    denied: tuple[str, ...] = ()


def first_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message``, short enough for the expected-failure list."""
    text = str(exc).strip().splitlines()
    line = next((s.strip() for s in text if s.strip()), "")
    out = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def _to_cpu(tree: Any) -> Any:
    return _map_tensors(lambda t: t.detach().cpu() if t.requires_grad else t.cpu(), tree)


class Comparer:
    """Runs cases on ``device`` against CPU."""

    def __init__(self, device: str, max_samples: int = 0) -> None:
        self.device = device
        self.max_samples = max_samples
        self.asserter = _Asserter()
        self.deny = deny_list.load()
        #: the samples of the case being run: (dtype, requires_grad, {id(sample): index})
        self._made: tuple[torch.dtype, bool, dict[int, int]] = (torch.float32, False, {})

    def run(self, op: Any, dtype_name: str, kind: str) -> Outcome:
        dtype = getattr(torch, dtype_name)
        skipped = pytorch_skip(op, dtype)
        if skipped:
            return Outcome("skip", f"PyTorch skips test_compare_cpu for this op on every device: {skipped}")
        torch.manual_seed(SEED)
        if kind == "forward":
            return self._samples(op, dtype, requires_grad=False, check=self._forward)
        if kind == "backward":
            return self._samples(op, dtype, requires_grad=True, check=self._backward)
        return Outcome("fail", f"unknown kind {kind!r} (forward or backward)")

    def _samples(self, op: Any, dtype: torch.dtype, requires_grad: bool,
                 check: Callable[[Any, Any], str | None]) -> Outcome:
        try:
            samples = list(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))
        except Exception as exc:  # the OpInfo cannot make CPU samples: not the device's fault
            return Outcome("skip", f"sample_inputs on CPU raised {first_line(exc)}")
        self._made = (dtype, requires_grad, {id(s): i for i, s in enumerate(samples)})
        return self.run_samples([(i, functools.partial(check, op, samples[i]))
                                 for i in spread(len(samples), self.max_samples)])

    def run_samples(self, checks: list[tuple[Any, Callable[[], str | None]]]) -> Outcome:
        """Run each (label, check) in turn: a check returns None (equal), a mismatch, or raises. The
        outcome fails at the first failing sample; a sample the server refuses for an op of the deny list
        (tests/device/deny_list.toml) is left out; one CPU cannot run (``NotComparable``) is skipped."""
        compared = not_comparable = 0
        denied: set[str] = set()
        for label, check in checks:
            try:
                verdict = check()
            except NotComparable:
                not_comparable += 1
                continue
            except Exception as exc:
                entry = deny_list.denied_by(exc, self.deny)
                if entry is not None:
                    denied.add(entry)
                    continue
                refused = deny_list.refused_op(exc)
                why = f" (refused {refused}: not in tests/device/deny_list.toml)" if refused else ""
                return Outcome("fail", f"sample {label}: {first_line(exc)}{why}", compared, tuple(sorted(denied)))
            if verdict is not None:
                return Outcome("fail", f"sample {label}: {verdict}", compared, tuple(sorted(denied)))
            compared += 1
        if compared == 0:
            if denied:
                return Outcome("denied", f"every sample refused: {', '.join(sorted(denied))}", 0,
                               tuple(sorted(denied)))
            why = f"none of {not_comparable} samples can be compared (CPU raises, or nothing to differentiate)" \
                if not_comparable else "no samples"
            return Outcome("skip", why)
        return Outcome("pass", "", compared, tuple(sorted(denied)))

    def _remote(self, sample: Any, leaves: bool, keep_on_cpu: frozenset[int] = frozenset()) -> Any:
        """The sample with its tensors on the device; the ``keep_on_cpu`` ones (by order of appearance) stay."""
        seen = iter(range(1 << 30))

        def move(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t  # SampleInput.transform hands dtypes over too
            if next(seen) in keep_on_cpu:
                return t
            if leaves:
                return with_storage(t.detach(), self.device).requires_grad_(t.requires_grad)
            return with_storage(t, self.device)

        return sample.transform(move)

    def _device_run(self, op: Any, sample: Any, remote: Any, leaves: bool) -> tuple[Any, Any]:
        """(the device's sample, the op's output there). A sample function may make a tensor on the CPU
        whatever device it is asked for (``tensor_split``'s indices: ``torch.tensor([1, 2])``), for an
        argument that must be on the CPU on every device (CUDA too); when the op refuses the moved tensor
        for that reason, the sample runs again with the tensors the same function makes on CPU when asked
        for the meta device left there, as PyTorch's test_compare_cpu (samples made on the device) has them.
        ``remote`` is the sample moved before the CPU reference ran (an op may change its input in place:
        ``embedding_bag(max_norm=...)`` renormalizes the weight)."""
        try:
            return remote, op(remote.input, *remote.args, **remote.kwargs)
        except RuntimeError as exc:
            keep = self._cpu_only_tensors(op, sample) if _CPU_ONLY.search(str(exc)) else frozenset()
            if not keep:
                raise
        remote = self._remote(sample, leaves, keep)
        return remote, op(remote.input, *remote.args, **remote.kwargs)

    def _cpu_only_tensors(self, op: Any, sample: Any) -> frozenset[int]:
        """The positions (in the order ``SampleInput.transform`` visits tensors) of the tensors the op's
        sample function makes on the CPU when asked for the meta device, in the sample of ``sample``'s
        index; empty when that cannot be told (meta samples fail, or the lists differ)."""
        dtype, requires_grad, index = self._made
        at = index.get(id(sample))
        try:
            candidates = list(op.sample_inputs("meta", dtype, requires_grad=requires_grad))
        except Exception:
            return frozenset()
        if at is None or at >= len(candidates) or len(index) != len(candidates):
            return frozenset()
        devices = _devices_in(candidates[at])
        if len(devices) != len(_devices_in(sample)):
            return frozenset()
        return frozenset(i for i, d in enumerate(devices) if d == "cpu")

    def compare(self, actual: Any, expected: Any, atol: float = ATOL, rtol: float = RTOL) -> str | None:
        """None when equal within the tolerances (PyTorch's TestCase.assertEqual), else the mismatch."""
        try:
            self.asserter.assertEqual(actual, expected, atol=atol, rtol=rtol)
        except AssertionError as exc:
            return f"mismatch: {first_line(exc)}"
        return None

    def _compare(self, actual: Any, expected: Any) -> str | None:
        try:
            self.asserter.assertEqual(actual, expected, atol=ATOL, rtol=RTOL)
        except AssertionError as exc:
            return f"mismatch: {first_line(exc)}"
        return None

    def _forward(self, op: Any, sample: Any) -> str | None:
        remote = self._remote(sample, leaves=False)  # before the CPU run, which may change the sample in place
        try:
            expected = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
        except Exception as exc:
            raise cpu_failure(exc) from exc
        remote, out = self._device_run(op, sample, remote, leaves=False)
        actual = _to_cpu(remote.output_process_fn_grad(out))
        return self._compare(actual, expected)

    def _backward(self, op: Any, sample: Any) -> str | None:
        cpu_inputs = _grad_inputs(sample)
        if not cpu_inputs:
            raise NotComparable  # nothing to differentiate: does not count as compared
        remote = self._remote(sample, leaves=True)
        try:
            cpu_out = _grad_outputs(sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs)))
            if not cpu_out:
                raise NotComparable
            cotangents = [torch.randn_like(t) for t in cpu_out]
            expected = torch.autograd.grad(cpu_out, cpu_inputs, cotangents, allow_unused=True)
        except NotComparable:
            raise
        except Exception as exc:
            raise cpu_failure(exc) from exc
        remote, out = self._device_run(op, sample, remote, leaves=True)
        remote_inputs = _grad_inputs(remote)
        remote_out = _grad_outputs(remote.output_process_fn_grad(out))
        if len(remote_out) != len(cpu_out):
            return f"{len(remote_out)} differentiable outputs on the device, {len(cpu_out)} on CPU"
        # each cotangent where its output is (an op like ``to("cpu")`` returns a CPU tensor on both sides)
        actual = torch.autograd.grad(remote_out, remote_inputs, [c.to(o.device) for c, o in
                                                                 zip(cotangents, remote_out, strict=True)],
                                     allow_unused=True)
        return self._compare(_to_cpu(list(actual)), list(expected))


def with_storage(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` on ``device`` as the same view of a copy of its whole storage, where it views part of a larger
    one (``base[5:15]``): ``as_strided`` and its partial-view samples address the storage, not the view, and
    ``t.to(device)`` would copy only the view's elements. Anything else moves with ``.to``."""
    if t.layout != torch.strided or (t.storage_offset() == 0 and _storage_span(t) * t.element_size()
                                     == t.untyped_storage().nbytes()):
        return t.to(device)
    whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes()
                                                                       // t.element_size(),), (1,))
    return whole.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def _storage_span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))


#: A kernel's refusal of a tensor argument that must live on the CPU (on CUDA too).
_CPU_ONLY = re.compile(r"expected \w+ to be on cpu|to be on CPU|must be on CPU", re.IGNORECASE)


def _devices_in(sample: Any) -> list[str]:
    found: list[str] = []

    def note(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            found.append(t.device.type)
        return t

    sample.transform(note)
    return found


def spread(count: int, limit: int) -> list[int]:
    """Indices of at most ``limit`` of ``count`` samples (all when ``limit`` is 0), spread evenly over
    the list: OpInfos order samples by kind (shapes, then options), so the first N would test one kind.
    A few OpInfos make hundreds of samples (max_pool1d: 864), which would cost minutes each."""
    if limit <= 0 or count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)}) if limit > 1 else [0]


class NotComparable(Exception):
    """The CPU reference cannot run this sample, or it has nothing to differentiate: skipped, not counted."""


def pytorch_skip(op: Any, dtype: torch.dtype, test_class: str = "TestCommon", test_name: str = "test_compare_cpu") -> str:
    """The reason PyTorch's OpInfo skips ``test_compare_cpu`` for ``op`` whatever the device
    (random ops: "output is non-deterministic"; ``empty``: "not comparable"), or "".

    Only device-independent skips count (a DecorateInfo with no device_type): CUDA's own skips and
    expected failures are CUDA's business; this device is judged against CPU alone.
    """
    for info in [*(getattr(op, "decorators", None) or ()), *(getattr(op, "skips", None) or ())]:
        if not hasattr(info, "is_active") or info.device_type is not None:
            continue
        if not info.is_active(test_class, test_name, "privateuse1", dtype, {}):
            continue
        for decorator in info.decorators:
            try:
                probe = decorator(lambda: None)
            except Exception:  # a decorator that wants a real test method is not a skip
                continue
            if getattr(probe, "__unittest_skip__", False):
                return str(getattr(probe, "__unittest_skip_why__", "skipped")) or "skipped"
    return ""


def cpu_failure(exc: Exception) -> Exception:
    """What a CPU-reference error means. Usually the sample is invalid on CPU (a CUDA-only op): not
    comparable. But registering the device can break CPU code too (OpInfo's ``freeze_rng_state``
    asks every registered backend for ``get_rng_state``): that is the device's failure."""
    if "remote_accelerator" in str(exc) or type(exc).__module__.split(".")[0] == "genie":
        return RuntimeError(f"the CPU reference raised because the device is registered: {first_line(exc)}")
    return NotComparable()


def _grad_inputs(sample: Any) -> list[torch.Tensor]:
    leaves = tree_leaves([sample.input, sample.args, sample.kwargs])
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]

