"""The worker process of the OpInfo sweep: ``python opinfo_worker.py`` (started by opinfo_pool).

It imports ``op_db`` once (on the first ``list``, ``load`` or ``run``), answers ``list`` with every case, ``init`` by connecting genie to a
server (``genie.init_sync``), and ``run`` by running one case and answering its outcome. Requests and
answers are JSON lines on stdin and on a private copy of stdout; fd 1 itself is pointed at stderr, so
nothing torch or a kernel prints can corrupt the protocol. A crash or hang here costs one case: the
pool kills and restarts this process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO, cast

DEVICE = "remote_accelerator:0"


def _protocol_out() -> TextIO:
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1, encoding="utf-8")


def list_cases(op_db: list[Any]) -> list[dict[str, str]]:
    import torch
    from opinfo_cases import BACKWARD_DTYPES, FORWARD_DTYPES, Case, server_devices

    # A server on a GPU runs each op in the dtypes the OpInfo declares for CUDA too (its dtypesIfCUDA), as
    # PyTorch's own test_compare_cpu does; CPU-only dtypes (int64 matmul, say) are not the device's to run.
    kinds = ("cpu", "cuda") if server_devices().startswith("cuda") else ("cpu",)
    cases: list[Case] = []
    for op in op_db:
        supported = set.intersection(*(set(op.supported_dtypes(k)) for k in kinds))
        for name in FORWARD_DTYPES:
            if getattr(torch, name) in supported:
                cases.append(Case(op.name, op.variant_test_name, name, "forward"))
        if op.supports_autograd:
            backward = set.intersection(*(set(op.supported_backward_dtypes(k)) for k in kinds))
            for name in BACKWARD_DTYPES:
                dtype = getattr(torch, name)
                if dtype in supported and dtype in backward:
                    cases.append(Case(op.name, op.variant_test_name, name, "backward"))
    import gates

    loaded = _loaded_gates()
    cases += gates.module_cases(loaded["module_db"]) + gates.optim_cases(loaded["optim_db"])
    cases += gates.random_cases() + gates.amp_cases()
    return [c.to_json() for c in sorted(set(cases))]


_GATE_DBS: dict[str, Any] = {}


def _loaded_gates() -> dict[str, Any]:
    """module_db and optim_db by name, imported once (each import takes seconds)."""
    if not _GATE_DBS:
        from torch.testing._internal.common_modules import module_db
        from torch.testing._internal.common_optimizers import optim_db

        _GATE_DBS["module_db"] = module_db
        _GATE_DBS["optim_db"] = optim_db
        _GATE_DBS["modules"] = {m.name: m for m in module_db}
        _GATE_DBS["optims"] = {cast(type, o.optim_cls).__name__: o for o in optim_db}
    return _GATE_DBS


def selftest(action: str) -> dict[str, Any]:
    """The harness's own tests (test_opinfo_harness.py) ask for these to prove a hang or a crash costs one case."""
    if action == "hang":
        time.sleep(3600)
    elif action == "abort":
        os.abort()
    elif action == "pass":
        if healthy():
            return {"status": "pass", "reason": "", "samples": 1}
        return {"status": "fail", "reason": "the device does not answer", "healthy": False}
    return {"status": "fail", "reason": f"unknown self-test {action!r}"}


def run_case(loaded: dict[str, Any], request: dict[str, str]) -> dict[str, Any]:
    import gates
    from opinfo_cases import Case

    case = Case.from_json(request)
    comparer = loaded["comparer"]
    name = case.op.split(":", 1)[-1]
    if case.gate == "opinfo":
        op = loaded["ops"].get((case.op, case.variant))
        if op is None:
            return {"status": "fail", "reason": f"no OpInfo {case.op!r} variant {case.variant!r}"}
        outcome = comparer.run(op, case.dtype, case.kind)
    elif case.gate == "module" and name in _loaded_gates()["modules"]:
        outcome = gates.run_module(comparer, _loaded_gates()["modules"][name], case)
    elif case.gate == "optim" and name in _loaded_gates()["optims"]:
        outcome = gates.run_optim(comparer, _loaded_gates()["optims"][name], case)
    elif case.gate == "random":
        outcome = gates.run_random(comparer, case)
    elif case.gate == "amp":
        outcome = gates.run_amp(comparer, case)
    else:
        return {"status": "fail", "reason": f"no case {case.test_id!r} in any gate"}
    answer: dict[str, Any] = {"status": outcome.status, "reason": outcome.reason, "samples": outcome.samples,
                              "denied": list(outcome.denied)}
    if outcome.status == "fail":
        answer["healthy"] = healthy()
    return answer


def healthy() -> bool:
    """Whether the device still answers after a failure (a lost session fails every later case)."""
    import torch

    try:
        return bool(torch.ones(3, device=DEVICE).sum().item() == 3.0)
    except Exception:
        return False


def main() -> int:
    out = _protocol_out()
    loaded: dict[str, Any] = {}

    def load() -> dict[str, Any]:
        # On first need, not at start: a worker that only runs self-tests (test_opinfo_harness.py)
        # then starts in a second instead of the ~5-15 s op_db's import takes.
        if not loaded:
            from opinfo_compare import Comparer
            from torch.testing._internal.common_methods_invocations import op_db

            loaded["op_db"] = op_db
            loaded["ops"] = {(op.name, op.variant_test_name): op for op in op_db}
            loaded["comparer"] = Comparer(DEVICE, max_samples=int(os.environ.get("GENIE_OPINFO_MAX_SAMPLES", "32")))
        return loaded

    out.write(json.dumps({"ready": True}) + "\n")
    from opinfo_cases import SELFTEST

    for line in sys.stdin:
        request = json.loads(line)
        cmd = request.get("cmd")
        if cmd == "list":
            answer: dict[str, Any] = {"cases": list_cases(load()["op_db"])}
        elif cmd == "load":
            answer = {"ok": bool(load())}
        elif cmd == "init":
            import genie

            try:
                genie.init_sync(master_addr=request["host"], master_port=request["port"], timeout=30)
                answer = {"ok": True}
            except Exception as exc:
                answer = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
        elif cmd == "run":
            started = time.perf_counter()
            if request["op"] == SELFTEST:
                answer = selftest(request["variant"])
            else:
                answer = run_case(load(), request)
            answer["seconds"] = round(time.perf_counter() - started, 4)
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        out.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
