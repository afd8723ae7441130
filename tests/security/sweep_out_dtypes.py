"""Every out= overload of the allow-list with an out tensor of the wrong dtype, against a real node and a bystander.

    .venv/bin/python -m tests.security.sweep_out_dtypes            # all of them (about a minute)

Some out forms write what their kernel computes into ``out`` as the kernel's own dtype, whatever ``out``'s
(``_logcumsumexp.out``: a float result into a uint8 out, 96 bytes into a 24-byte buffer; issue 28). For each
out overload this finds arguments its functional form accepts (small tensors and plain values, the
pre-flight's checks passed, run on this process's CPU), then asks a real node to run the out form with one
out tensor of another dtype, both as a storage the session holds and as a fresh one (the executor then runs
the functional form first). Each call must be refused, or give the functional result converted to the out's
dtype; the session's worker must survive; a bystander session must read its tensor back unchanged.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

import attrs
import torch

from genie.errors import GenieError
from genie.server import preflight
from genie.server.allowlist import entries
from genie.server.ops import registered_op_names, resolve_op
from genie.server.outputs import functional_of
from genie.testing import serve_subprocess
from tests.raw_client import Dev, Gen, RawClient, T, free, op, sync

_BYSTANDER = torch.arange(256, dtype=torch.float64) * 0.5
#: Ops whose results are random: their values are not compared.
_RANDOM = ("rand", "normal", "bernoulli", "dropout", "poisson", "multinomial", "exponential", "uniform",
           "geometric", "cauchy", "log_normal", "random")
_MAX_TRIES = 400


def out_overloads() -> list[tuple[str, torch._ops.OpOverload]]:
    """(name, overload) of every allowed op with out arguments, sorted by name."""
    exact, packets = entries()
    found = []
    for name in sorted(n for n in registered_op_names() if n in exact or n.split(".", 1)[0] in packets):
        try:
            overload = resolve_op(name)
        except GenieError:
            continue
        if any(a.is_out for a in overload._schema.arguments):
            found.append((name, overload))
    return found


def _candidates(argument: Any) -> list[Any]:
    """Plain values to try for one schema argument, the likeliest first."""
    real, kind = str(argument.real_type), argument.real_type.kind()
    g = torch.Generator().manual_seed(0)
    if real == "Tensor":
        return [torch.randn(3, 4, generator=g), torch.randn(4, generator=g), torch.randn(2, 3, 4, generator=g),
                torch.randint(0, 3, (3, 4), generator=g), torch.rand(3, 3, generator=g) + torch.eye(3) * 3]
    table: dict[str, list[Any]] = {
        "Optional[Tensor]": [None, torch.randn(3, 4, generator=g)],
        "List[Tensor]": [[torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)]],
        "List[Optional[Tensor]]": [[torch.tensor([0, 1])]],
        "Optional[int]": [None, 1], "Optional[SymInt]": [None, 1],
        "Optional[List[int]]": [None, [0]], "Optional[List[SymInt]]": [None, [0]],
        "Optional[float]": [None, 0.5], "Optional[number]": [None, 1], "Optional[bool]": [None, False],
        "Optional[str]": [None, "floor", "linear"], "ScalarType": [torch.float32],
        "Device": [torch.device("cpu")], "Generator": [None],
    }
    if real in table:
        return table[real]
    if real.startswith("Optional[") and real[9:-1] in ("ScalarType", "Layout", "Device", "Generator", "MemoryFormat"):
        return [None]
    if kind in ("IntType", "SymIntType"):
        return [0, 1, 2]
    if kind == "ListType" and argument.real_type.getElementType().kind() in ("IntType", "SymIntType"):
        return [[], [0], [3, 4], [1, 1], [2]]
    simple: dict[str, list[Any]] = {"FloatType": [0.5], "NumberType": [1, 0.5], "BoolType": [False, True],
              "StringType": ["mean", "none", "sum", "reflect", "floor", "linear"]}
    if kind in simple:
        return simple[kind]
    raise LookupError(real)


@attrs.frozen
class Sample:
    """Arguments an out overload's functional form accepts, and what it returned on this process's CPU."""

    args: list[Any]
    kwargs: dict[str, Any]
    results: list[torch.Tensor]
    out_names: tuple[str, ...]


def sample(overload: torch._ops.OpOverload) -> Sample | None:
    """Arguments for ``overload`` (tried one or two at a time off the likeliest), or None when none work."""
    out_names, functional = functional_of(overload)
    if functional is None:
        return None
    arguments = list(functional._schema.arguments)
    try:
        choices = [_candidates(a) for a in arguments]
    except LookupError:
        return None
    base = [c[0] for c in choices]
    tries = [base] + [[*base[:i], v, *base[i + 1:]] for i, c in enumerate(choices) for v in c[1:]]
    for i, j in itertools.combinations(range(len(choices)), 2):
        tries += [[*base[:i], vi, *base[i + 1:j], vj, *base[j + 1:]] for vi in choices[i][1:] for vj in choices[j][1:]]
    for values in tries[:_MAX_TRIES]:
        args = [v for a, v in zip(arguments, values, strict=True) if not a.kwarg_only]
        kwargs = {a.name: v for a, v in zip(arguments, values, strict=True) if a.kwarg_only}
        try:  # the server's own checks first: this process must not run what a node would refuse
            preflight.check(functional, functional.name(), args, kwargs, max_elements=1 << 20,
                            remaining_bytes=1 << 24)
            result = functional(*args, **kwargs)
        except Exception:  # noqa: BLE001 - these arguments do not suit it; try the next
            continue
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        if all(isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() for t in results):
            return Sample(args, kwargs, results, out_names)
    return None


def mismatching(dtype: torch.dtype) -> list[torch.dtype]:
    """Out dtypes other than ``dtype``: narrower (a kernel that writes its own dtype overruns them) and wider."""
    if dtype.is_floating_point:
        return [torch.uint8, torch.float64, torch.int64]
    if dtype.is_complex:
        return [torch.float32]
    if dtype == torch.bool:
        return [torch.float32, torch.int64]
    return [torch.uint8, torch.float32, torch.float64]


@attrs.define
class Report:
    """What a sweep did."""

    overloads: int = 0
    sampled: int = 0
    calls: int = 0
    refused: int = 0
    converted: int = 0
    wrong_values: list[str] = attrs.Factory(list)
    sessions_lost: list[str] = attrs.Factory(list)
    node_deaths: int = 0
    bystander_failures: int = 0

    def summary(self) -> str:
        return (f"out overloads {self.overloads} (with arguments found: {self.sampled}), calls {self.calls}: "
                f"refused {self.refused}, converted right {self.converted}, wrong values {len(self.wrong_values)}, "
                f"sessions lost {len(self.sessions_lost)}, node deaths {self.node_deaths}, bystander failures "
                f"{self.bystander_failures}")


#: Storage ids of the sweep's tensors (a session never reuses one, even freed).
_IDS = itertools.count(100)


class _Wire:
    """Plain values as the raw client sends them; tensors uploaded as storages of fresh ids."""

    def __init__(self) -> None:
        self.uploads: list[tuple[int, int, torch.Tensor]] = []
        self._ids = _IDS

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            sid = next(self._ids)
            self.uploads.append((sid, 0, value.contiguous()))
            return T(sid, value.contiguous())
        if isinstance(value, (list, tuple)):
            return [self(v) for v in value]
        if isinstance(value, torch.device):
            return Dev(0)
        if isinstance(value, torch.Generator):
            return Gen(0)
        return value

    def fresh(self, like: torch.Tensor, dtype: torch.dtype) -> T:
        """An out tensor over a storage id the session has not made yet."""
        sid = next(self._ids)
        return T(sid, torch.empty(like.shape, dtype=dtype, device="meta"))


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    try:
        return bool(torch.allclose(got.to(torch.float64), want.to(got.dtype).to(torch.float64), rtol=1e-2, atol=1.01,
                                   equal_nan=True))
    except RuntimeError:
        return False


def _one(client: RawClient, name: str, overload: Any, s: Sample, index: int, dtype: torch.dtype, fresh: bool,
         report: Report) -> None:
    wire = _Wire()
    args, kwargs = wire(s.args), {k: wire(v) for k, v in s.kwargs.items()}
    outs = []
    for i, (out_name, result) in enumerate(zip(s.out_names, s.results, strict=True)):
        out_dtype = dtype if i == index else result.dtype
        if fresh:
            kwargs[out_name] = wire.fresh(result, out_dtype)
        else:
            kwargs[out_name] = wire(torch.zeros(result.shape, dtype=out_dtype))
        outs.append(kwargs[out_name])
    report.calls += 1
    reply = client.request([op(name, args, kwargs, outs=[None] * len(overload._schema.returns)),
                            sync(client.next_req())], wire.uploads)
    if reply.deferred or reply.error:
        report.refused += 1
    elif not any(word in name for word in _RANDOM):
        got = client.fetch(outs[index].value)
        if _agrees(got, s.results[index]):
            report.converted += 1
        else:
            report.wrong_values.append(f"{name} out {s.out_names[index]} as {dtype} ({'fresh' if fresh else 'held'})")
    ids = [u[0] for u in wire.uploads] + ([o.value[0] for o in outs] if fresh else [])
    client.request([free(*ids), sync(client.next_req())])


def run(only: list[str] | None = None, *, log: Any = None) -> Report:
    """Sweep the out overloads (``only``: these names) against a fresh node; return the report."""
    report = Report()
    todo = [(n, o) for n, o in out_overloads() if not only or n in only]
    report.overloads = len(todo)
    samples = [(n, o, s) for n, o in todo if (s := sample(o)) is not None]
    report.sampled = len(samples)
    with serve_subprocess("--port", "0", "--devices", "cpu", log_level="WARNING") as server:
        bystander = RawClient(server.port)
        bystander.handshake()
        bystander.request([sync(bystander.next_req())], [(1, 0, _BYSTANDER)])
        client = RawClient(server.port)
        client.handshake()
        for name, overload, s in samples:
            for index, result in enumerate(s.results):
                for dtype, fresh in itertools.product(mismatching(result.dtype), (False, True)):
                    try:
                        _one(client, name, overload, s, index, dtype, fresh, report)
                    except (GenieError, OSError, AssertionError) as exc:
                        report.sessions_lost.append(f"{name} ({dtype}): {type(exc).__name__}: {exc}"[:300])
                        if log:
                            log(f"session lost on {name} out {index} as {dtype}: {server.log()[-1500:]}")
                        client.close()
                        if not server.alive():
                            report.node_deaths += 1
                            return report
                        client = RawClient(server.port)
                        client.handshake()
        if not torch.equal(bystander.fetch(1, _BYSTANDER), _BYSTANDER):
            report.bystander_failures += 1
        client.close()
        bystander.close()
        report.node_deaths += not server.alive()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", action="append", help="sweep only this overload (repeatable)")
    opts = parser.parse_args(argv)
    report = run(opts.op, log=lambda text: print(text, file=sys.stderr, flush=True))
    print(report.summary())
    for line in [*report.wrong_values, *report.sessions_lost]:
        print(line)
    return 1 if report.wrong_values or report.sessions_lost or report.node_deaths or report.bystander_failures else 0


if __name__ == "__main__":
    sys.exit(main())
