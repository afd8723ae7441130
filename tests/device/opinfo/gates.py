"""The completeness gates beside OpInfo, run by the same worker against the same server (issue 29).

- ``module:<name>``: PyTorch's ModuleInfo database (``common_modules.module_db``), as its
  ``test_cpu_gpu_parity``: each module input builds the module on CPU, a deep copy goes to the device,
  outputs (variant ``train`` or ``eval``; kind ``forward``) and then gradients of the parameters and inputs
  for the same random cotangents (kind ``backward``) are compared with CPU's; float32, float64 too.
- ``optim:<name>``: PyTorch's ``optim_db``: every configuration its ``optim_inputs_func`` makes (amsgrad,
  maximize, weight decay, ... variants) in the plain, ``foreach`` and ``fused`` forms (fused where the
  optimizer supports it on CPU): three steps on a small model's parameters, compared with CPU's.
- ``random:<op>``: torch's random ops, variant ``default`` or ``generator`` (a seeded ``torch.Generator``):
  each must run; on a CPU server the draws equal CPU's for the same seed (docs/device.md, "Random
  numbers"); on any other server the draws are checked by their distribution (range, mean).
- ``amp:step``: autocast and ``torch.amp.GradScaler`` steps in float16 and bfloat16 compared with the CPU's.

Each gate's cases are :class:`opinfo_cases.Case` values; outcomes go through
:meth:`opinfo_compare.Comparer.run_samples`, so the deny list and the expected-failure list apply alike.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from opinfo_cases import Case, server_devices
from opinfo_compare import Comparer, NotComparable, Outcome, cpu_failure, pytorch_skip
from torch.utils._pytree import tree_leaves, tree_map

MODULE, OPTIM, RANDOM, AMP = "module:", "optim:", "random:", "amp:"
#: Sizes of the random gate's draws: large enough for a distribution check, small enough to be quick.
DRAWS = 4096


def _cpu_tree(tree: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def _to(tree: Any, device: str) -> Any:
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().to(device).requires_grad_(t.requires_grad)

    return tree_map(move, tree)


# -- ModuleInfo ---------------------------------------------------------------------------------------

def module_cases(module_db: list[Any]) -> list[Case]:
    cases = []
    for info in module_db:
        for dtype in ("float32", "float64"):
            if getattr(torch, dtype) not in info.dtypes:
                continue
            for variant in ("train", "eval"):
                cases += [Case(MODULE + info.name, variant, dtype, kind) for kind in ("forward", "backward")]
    return cases


def run_module(comparer: Comparer, info: Any, case: Case) -> Outcome:
    dtype = getattr(torch, case.dtype)
    skipped = pytorch_skip(info, dtype, "TestModule", "test_cpu_gpu_parity")
    if skipped:
        return Outcome("skip", f"PyTorch skips test_cpu_gpu_parity for this module on every device: {skipped}")
    training = case.variant == "train"
    try:
        inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=training)
    except Exception as exc:
        return Outcome("skip", f"module_inputs_func on CPU raised {type(exc).__name__}: {exc}"[:240])
    inputs = [m for m in inputs if m.forward_input is not None]
    backward = case.kind == "backward"
    return comparer.run_samples([
        (i, lambda m=m: _module_sample(comparer, info.module_cls, m, dtype, training, backward))
        for i, m in enumerate(inputs[: comparer.max_samples or None])])


def _module_sample(comparer: Comparer, cls: Any, module_input: Any, dtype: torch.dtype, training: bool,
                   backward: bool) -> str | None:
    c_args, c_kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    f_args, f_kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
    try:
        torch.manual_seed(SEED_MODULE)
        module = cls(*c_args, **c_kwargs).to(dtype)
        module.train(training)
        if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in module.parameters()):
            module(*f_args, **f_kwargs)  # a lazy module sees an input before it has parameters
        remote_module = copy.deepcopy(module)
        cpu_out = module(*f_args, **f_kwargs)
    except Exception as exc:
        raise cpu_failure(exc) from exc
    remote_module = remote_module.to(comparer.device)
    r_args, r_kwargs = _to(f_args, comparer.device), _to(f_kwargs, comparer.device)
    remote_out = remote_module(*r_args, **r_kwargs)
    if not backward:
        return comparer.compare(_cpu_tree(remote_out), _cpu_tree(cpu_out))
    cpu_outs = [t for t in tree_leaves(cpu_out) if isinstance(t, torch.Tensor) and t.requires_grad]
    remote_outs = [t for t in tree_leaves(remote_out) if isinstance(t, torch.Tensor) and t.requires_grad]
    cpu_wrt = [p for p in module.parameters() if p.requires_grad] + \
        [t for t in tree_leaves([f_args, f_kwargs]) if isinstance(t, torch.Tensor) and t.requires_grad]
    remote_wrt = [p for p in remote_module.parameters() if p.requires_grad] + \
        [t for t in tree_leaves([r_args, r_kwargs]) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not cpu_outs or not cpu_wrt:
        raise NotComparable
    if len(remote_outs) != len(cpu_outs):
        return f"{len(remote_outs)} differentiable outputs on the device, {len(cpu_outs)} on CPU"
    cotangents = [torch.randn_like(t) for t in cpu_outs]
    try:
        expected = torch.autograd.grad(cpu_outs, cpu_wrt, cotangents, allow_unused=True)
    except Exception as exc:
        raise cpu_failure(exc) from exc
    actual = torch.autograd.grad(remote_outs, remote_wrt, [c.to(comparer.device) for c in cotangents],
                                 allow_unused=True)
    return comparer.compare(_cpu_tree(list(actual)), list(expected))


SEED_MODULE = 20261127


# -- optim_db -----------------------------------------------------------------------------------------

def optim_cases(optim_db: list[Any]) -> list[Case]:
    cases = []
    for info in optim_db:
        impls = ["plain"] + [i for i in ("foreach", "fused") if i in info.supported_impls]
        if "fused" in impls and "cpu" not in info.supports_fused_on:
            impls.remove("fused")  # no CPU reference to compare with
        cases += [Case(OPTIM + info.optim_cls.__name__, impl, "float32", "step") for impl in impls]
    return cases


def run_optim(comparer: Comparer, info: Any, case: Case) -> Outcome:
    if info.optim_cls.__name__ == "SparseAdam":
        return Outcome("skip", "SparseAdam takes sparse gradients: sparse layouts are not served")
    try:
        configs = info.optim_inputs_func(device="cpu", dtype=torch.float32)
    except TypeError:
        configs = info.optim_inputs_func(device="cpu")
    checks = []
    for config in configs:
        kwargs = dict(config.kwargs)
        if case.variant != "plain":
            kwargs[case.variant] = True
        if case.variant == "fused":
            kwargs.pop("foreach", None)
        checks.append((config.desc or "default", lambda k=kwargs: _optim_sample(comparer, info.optim_cls, k)))
    return comparer.run_samples(checks)


def _optim_params(device: str) -> list[torch.Tensor]:
    torch.manual_seed(SEED_MODULE)
    return [torch.randn(5, 4).to(device).requires_grad_(), torch.randn(5).to(device).requires_grad_()]


def _optim_steps(cls: Any, kwargs: dict[str, Any], device: str) -> list[torch.Tensor]:
    params = _optim_params(device)
    if cls.__name__ == "Muon":  # Muon updates matrices only; the bias then trains with nothing
        params[1].requires_grad_(False)
    opt = cls([p for p in params if p.requires_grad], **kwargs)
    x = torch.linspace(-1, 1, 12).reshape(3, 4).to(device)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((x @ params[0].t() + params[1]).tanh() ** 2).sum()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    return [p.detach().cpu() for p in params]


def _optim_sample(comparer: Comparer, cls: Any, kwargs: dict[str, Any]) -> str | None:
    try:
        expected = _optim_steps(cls, kwargs, "cpu")
    except Exception as exc:
        raise cpu_failure(exc) from exc
    return comparer.compare(_optim_steps(cls, kwargs, comparer.device), expected, atol=1e-5, rtol=1e-4)


# -- random ops ---------------------------------------------------------------------------------------

def _draws() -> dict[str, tuple[Callable[..., torch.Tensor], tuple[float, float] | None, float | None]]:
    """name -> (draw(device, generator), the values' range or None, their mean or None)."""
    n = DRAWS
    p = torch.full((n,), 0.3)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    base = torch.empty(n)
    return {
        "rand": (lambda d, g: torch.rand(n, device=d, generator=g), (0, 1), 0.5),
        "randn": (lambda d, g: torch.randn(n, device=d, generator=g), None, 0.0),
        "randint": (lambda d, g: torch.randint(3, 10, (n,), device=d, generator=g), (3, 9), 6.0),
        "randperm": (lambda d, g: torch.randperm(n, device=d, generator=g), (0, n - 1), (n - 1) / 2),
        "bernoulli": (lambda d, g: torch.bernoulli(p.to(d), generator=g), (0, 1), 0.3),
        "bernoulli_": (lambda d, g: base.to(d).bernoulli_(0.7, generator=g), (0, 1), 0.7),
        "multinomial": (lambda d, g: torch.multinomial(weights.to(d), n, replacement=True, generator=g),
                        (0, 3), 2.0),
        "normal": (lambda d, g: torch.normal(2.0, 3.0, (n,), device=d, generator=g), None, 2.0),
        "normal_tensor": (lambda d, g: torch.normal(torch.full((n,), 2.0).to(d), 1.0, generator=g), None, 2.0),
        "normal_": (lambda d, g: base.to(d).normal_(1.0, 2.0, generator=g), None, 1.0),
        "poisson": (lambda d, g: torch.poisson(torch.full((n,), 4.0).to(d), generator=g), (0, 1e9), 4.0),
        "random_": (lambda d, g: base.to(d).random_(0, 50, generator=g), (0, 49), 24.5),
        "uniform_": (lambda d, g: base.to(d).uniform_(-2, 2, generator=g), (-2, 2), 0.0),
        "exponential_": (lambda d, g: base.to(d).exponential_(2.0, generator=g), (0, 1e9), 0.5),
        "geometric_": (lambda d, g: base.to(d).geometric_(0.5, generator=g), (1, 1e9), 2.0),
        "log_normal_": (lambda d, g: base.to(d).log_normal_(0.0, 0.25, generator=g), (0, 1e9), math.exp(0.03125)),
        "cauchy_": (lambda d, g: base.to(d).cauchy_(0.0, 1.0, generator=g), None, None),
        "rand_like": (lambda d, g: torch.rand_like(base.to(d), generator=g), (0, 1), 0.5),
        "randn_like": (lambda d, g: torch.randn_like(base.to(d), generator=g), None, 0.0),
        "randint_like": (lambda d, g: torch.randint_like(base.to(d), 0, 7, generator=g), (0, 6), 3.0),
        "dropout": (lambda d, g: torch.nn.functional.dropout(torch.ones(n).to(d), 0.25), (0, 4 / 3), 1.0),
    }


def random_cases() -> list[Case]:
    return [Case(RANDOM + name, variant, "float32", "draw") for name in sorted(_draws())
            for variant in ("default", "generator")]


def run_random(comparer: Comparer, case: Case) -> Outcome:
    name = case.op[len(RANDOM):]
    draw, bounds, mean = _draws()[name]
    if case.variant == "generator" and name == "dropout":
        return Outcome("skip", "dropout takes no generator")
    exact = server_devices().startswith("cpu")

    def sample() -> str | None:
        device_gen = torch.Generator(device=comparer.device) if case.variant == "generator" else None
        cpu_gen = torch.Generator() if case.variant == "generator" else None
        for g in (device_gen, cpu_gen):
            if g is not None:
                g.manual_seed(1234)
        torch.manual_seed(1234)
        got = draw(comparer.device, device_gen).cpu()
        torch.manual_seed(1234)
        want = draw("cpu", cpu_gen)
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            return f"{got.dtype}{list(got.shape)} on the device, {want.dtype}{list(want.shape)} on CPU"
        if exact:  # a CPU server draws from a CPU generator seeded alike
            return comparer.compare(got, want, atol=0, rtol=0)
        values = got.double()
        if bounds is not None and not (values.min() >= bounds[0] and values.max() <= bounds[1]):
            return f"values outside [{bounds[0]}, {bounds[1]}]: {values.min().item()}..{values.max().item()}"
        if mean is not None and abs(values.mean().item() - mean) > 0.1 * max(1.0, abs(mean)):
            return f"mean {values.mean().item():.4f}, expected about {mean}"
        return None

    return comparer.run_samples([(0, sample)])


# -- AMP ------------------------------------------------------------------------------------------------

def amp_cases() -> list[Case]:
    return [Case(AMP + "step", "", dtype, "step") for dtype in ("float16", "bfloat16")]


def run_amp(comparer: Comparer, case: Case) -> Outcome:
    dtype = getattr(torch, case.dtype)

    def steps(device: str) -> tuple[list[float], float, list[torch.Tensor]]:
        torch.manual_seed(SEED_MODULE)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 3)).to(device)
        kind = torch.device(device).type
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(kind, init_scale=2.0**12)
        x, y = torch.randn(6, 8).to(device), torch.tensor([0, 1, 2, 0, 1, 2]).to(device)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast(kind, dtype=dtype):
                out = model(x)
                if out.dtype != dtype:
                    raise AssertionError(f"autocast made {out.dtype} on {device}, not {dtype}")
                loss = torch.nn.functional.cross_entropy(out, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        return losses, float(scaler.get_scale()), [p.detach().cpu() for p in model.parameters()]

    def sample() -> str | None:
        try:
            want = steps("cpu")
        except Exception as exc:
            raise cpu_failure(exc) from exc
        got = steps(comparer.device)
        if got[1] != want[1]:
            return f"GradScaler's scale {got[1]} on the device, {want[1]} on CPU (an inf/nan found on one side)"
        return comparer.compare([torch.tensor(got[0]), *got[2]], [torch.tensor(want[0]), *want[2]],
                                atol=2e-2, rtol=2e-2)

    return comparer.run_samples([(0, sample)])
