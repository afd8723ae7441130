"""Schema-driven op fuzzer: every allowed op, edge-case arguments, a real server process, a bystander session.

    .venv/bin/python -m tests.security.fuzz_ops --seconds 900      # or: nox -s fuzz_ops
    .venv/bin/python -m tests.security.fuzz_ops --seconds 30 --seed 7 --op aten::_fft_r2c

For each call the fuzzer picks an op from the server's allow-list
(genie/server/allowed_ops.txt), reads its schema (``OpOverload._schema``) and
draws every argument from edge cases of its type: empty and zero-size tensors,
scalars, stride-0 views expanded to huge sizes, NaN and infinities, integers at
the int32/int64 limits, negative dims, lists of mismatched lengths, odd dtypes.
Calls go through a real session of a real ``python -m genie.server`` process
over the wire's raw client (tests/raw_client.py), so nothing on the client
side (its meta kernels, its checks) filters them.

After each call it checks that the server process is alive and, every few
calls, that a bystander session (another connection holding a known tensor)
still reads its bytes back unchanged. A dead server is restarted; the op and
arguments that killed it are reported. The run is deterministic for a seed.

``--graphs`` sends every other call as the one node of a graph (GRAPH, then
REPLAY), so the replay path's gate is fuzzed with the same draws as the op path.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import msgpack
import torch

from genie.errors import GenieError
from genie.server.allowlist import entries
from genie.server.ops import registered_op_names, resolve_op
from genie.testing import serve_subprocess, wait_until
from genie.wire.graph import Ref, encode_definition
from genie.wire.messages import CMD_GRAPH, CMD_REPLAY
from genie.wire.values import EXT_TENSOR
from tests.raw_client import Dev, Gen, RawClient, T, desc, encode_value, op, pack, sync

#: Storage ids of the fuzzer's own tensors (uploaded once per session), and what each holds.
_BASE: dict[int, torch.Tensor] = {
    1: torch.arange(12, dtype=torch.float32).reshape(4, 3),
    2: torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64),
    3: torch.tensor([True, False, True]),
    4: torch.tensor(2.5),
    5: torch.empty(0),
    6: torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)),
    7: torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]),
    8: torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
    9: torch.tensor([200, 0, 7], dtype=torch.uint8),
}
#: Calls between two fresh attacker sessions.
FRESH_EVERY = 100
_POINTER = re.compile(r"0x[0-9a-fA-F]{8,}")
#: A decimal in the range of user-space heap and mmap addresses on x86-64 Linux (0x5500_0000_0000 and up): a word
#: read from memory printed in base 10, which no draw of this fuzzer gives.
_DECIMAL = re.compile(r"(?<![\d.])\d{14,15}(?![\d.])")


def leaked_word(text: str) -> bool:
    """Whether an error text shows a memory address, in hex or in decimal."""
    return bool(_POINTER.search(text)) or any(0x5500_0000_0000 <= int(m) < 0x8000_0000_0000
                                              for m in _DECIMAL.findall(text))
_BYSTANDER = torch.arange(1000, dtype=torch.float64) * 1.5

_INTS = [0, 1, 2, 3, -1, -2, 7, 2**31 - 1, 2**31, -(2**31), 2**40, 2**62, -(2**63), 2**63 - 1]
_FLOATS = [0.0, 1.5, -1.0, float("nan"), float("inf"), -float("inf"), 1e308, 5e-324]
_INT_LISTS: list[list[int]] = [[], [0], [2], [2, 3], [-1], [3, 4], [2**31], [2**40, 2**40], [1, -5, 2], [0, 0, 0],
                               [1] * 70]
_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16,
           torch.complex64, torch.uint8, torch.int8]
_STRINGS = ["", "mean", "sum", "none", "reflect", "constant", "linear", "floor", "trunc", "tanh", "x" * 200]


def _view(storage_id: int, sizes: list[int], strides: list[int], offset: int = 0) -> T:
    """A view of one of the fuzzer's storages (its dtype) with these sizes and strides."""
    base = _BASE[storage_id]
    return T([storage_id, desc(storage_id, base)[1], sizes, strides, offset, base.untyped_storage().nbytes()])


def _tensor(rng: random.Random) -> T:
    roll = rng.random()
    if roll < 0.6:
        sid = rng.choice(list(_BASE))
        return T(sid, _BASE[sid])
    sid = rng.choice([1, 2, 6])
    if roll < 0.75:  # stride-0 expansion of one element, up to 2**40 elements
        n = rng.choice([0, 1, 5, 2**20, 2**26, 2**40])
        return _view(sid, [n], [0])
    if roll < 0.85:  # a 2-d stride-0 broadcast
        return _view(sid, [rng.choice([3, 2**13, 2**20]), rng.choice([3, 2**13, 2**16])], [0, 0])
    if roll < 0.95:  # a transposed / overlapping view
        return _view(sid, [3, 4], [1, 1])
    return _view(sid, [2, 0, 3], [0, 3, 1])


@attrs.define
class Report:
    """What a run did: ops tried, calls sent, server deaths (with the call that caused each), bystander checks."""

    ops: set[str] = attrs.Factory(set)
    calls: int = 0
    errors: int = 0
    deaths: list[str] = attrs.Factory(list)
    session_losses: int = 0
    bystander_checks: int = 0
    bystander_failures: list[str] = attrs.Factory(list)
    seconds: float = 0.0
    #: The slowest calls: (seconds, op).
    slowest: list[tuple[float, str]] = attrs.Factory(list)
    losses: list[str] = attrs.Factory(list)
    #: Error messages that carried a heap address (0x and 8+ hex digits, or a decimal in the address range).
    leaks: list[str] = attrs.Factory(list)
    #: Calls sent as a one-node graph and its replay (``graphs=True``).
    graph_calls: int = 0

    def summary(self) -> str:
        return (f"ops tried {len(self.ops)}, calls {self.calls} (as graph nodes: {self.graph_calls}; "
                f"refused or failed cleanly: {self.errors}), "
                f"server deaths {len(self.deaths)}, leaked addresses {len(self.leaks)}, sessions lost {self.session_losses}, bystander checks "
                f"{self.bystander_checks} (failed {len(self.bystander_failures)}), {self.seconds:.1f} s")


def _arg(rng: random.Random, type_: Any, name: str) -> Any:
    """An edge-case value for one schema argument type (``Argument.real_type``, a ``torch._C`` JIT type)."""
    kind = type_.kind()
    real = str(type_)
    if real in ("ScalarType", "Layout", "MemoryFormat") and rng.random() < 0.1:
        return rng.choice(_INTS)  # the JIT schema takes these as ints: a raw int must be refused
    if real == "ScalarType":
        return rng.choice(_DTYPES)
    if real == "Layout":
        return rng.choice([torch.strided, torch.sparse_coo])
    if real == "MemoryFormat":
        return rng.choice([torch.contiguous_format, torch.channels_last, torch.preserve_format])
    if kind == "OptionalType":
        return None if rng.random() < 0.3 else _arg(rng, type_.getElementType(), name)
    if kind == "TensorType":
        return _tensor(rng)
    if kind == "ListType":
        elem = type_.getElementType()
        if elem.kind() in ("IntType", "SymIntType"):
            return list(rng.choice(_INT_LISTS))
        if elem.kind() == "OptionalType" and elem.getElementType().kind() == "TensorType":
            return [None if rng.random() < 0.3 else _tensor(rng) for _ in range(rng.choice([0, 1, 2, 3]))]
        return [_arg(rng, elem, name) for _ in range(rng.choice([0, 1, 2, 3, 5]))]
    if kind in ("IntType", "SymIntType"):
        return rng.choice(_INTS)
    if kind == "FloatType":
        return rng.choice(_FLOATS)
    if kind == "BoolType":
        return rng.random() < 0.5
    if kind == "NumberType":  # Scalar
        return rng.choice(_INTS + _FLOATS + [True, 1 + 1j])
    if kind == "StringType":
        return rng.choice(_STRINGS)
    if kind == "DeviceObjType":
        return Dev(rng.choice([0, 0, 0, 1, -1]))
    if kind == "GeneratorType":
        return Gen(rng.choice([0, 0, 1, 2**40]))
    raise LookupError(kind)


def fuzzable_ops(only: list[str] | None = None) -> list[tuple[str, Any]]:
    """(name, schema) of every allowed op the fuzzer can draw arguments for, sorted by name."""
    exact, packets = entries()
    names = {n for n in registered_op_names() if n in exact or n.split(".", 1)[0] in packets}
    if only:
        names = {n for n in names if n in only}
    out = []
    probe = random.Random(0)
    for name in sorted(names):
        try:
            overload = resolve_op(name)
        except GenieError:
            continue
        schema = overload._schema
        try:
            for a in schema.arguments:
                _arg(probe, a.real_type, a.name)
        except LookupError:
            continue
        out.append((name, schema))
    return out


def _call(rng: random.Random, name: str, schema: Any) -> bytes:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in schema.arguments:
        value = _arg(rng, a.real_type, a.name)
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    if rng.random() < 0.1 and args:
        args.pop()  # too few arguments
    return op(name, args, kwargs, outs=[None] * len(schema.returns))


def _decoded_tensor(value: Any) -> bool:
    return isinstance(value, msgpack.ExtType) and value.code == EXT_TENSOR


def graph_inputs(value: Any, inputs: list[Any], is_tensor: Any = _decoded_tensor) -> Any:
    """An op argument with every tensor (``is_tensor``: a decoded tensor tag by default) made a graph input:
    appended to ``inputs``, replaced by a Ref to its slot."""
    if is_tensor(value):
        inputs.append(value)
        return Ref(len(inputs) - 1)
    if isinstance(value, list):
        return [graph_inputs(v, inputs, is_tensor) for v in value]
    if isinstance(value, dict):
        return {k: graph_inputs(v, inputs, is_tensor) for k, v in value.items()}
    return value


def as_graph(cmd: bytes, name: str, req: int, graph_id: int) -> tuple[bytes, bytes]:
    """The op command ``cmd`` (as :func:`_call` draws it) as the one node of graph ``graph_id``: its GRAPH
    definition (request ``req``) and the REPLAY that runs it on the same tensors."""
    _, _, _, args, kwargs, _ = msgpack.unpackb(cmd, strict_map_key=False,
                                               ext_hook=lambda code, data: msgpack.ExtType(code, data))
    inputs: list[Any] = []
    node = [name, graph_inputs(args, inputs), graph_inputs(kwargs, inputs)]
    define = pack([CMD_GRAPH, req, 0, graph_id, encode_definition(len(inputs), [node], [], encode_value)])
    return define, pack([CMD_REPLAY, 0, graph_id, inputs, []])


class _Session:
    """One raw session with the fuzzer's tensors uploaded."""

    def __init__(self, port: int, data: dict[int, torch.Tensor]) -> None:
        self.client = RawClient(port, timeout=30.0)
        self.client.handshake()
        self.client.request([sync(self.client.next_req())], [(sid, 0, t) for sid, t in data.items()])

    def close(self) -> None:
        self.client.close()


@contextlib.contextmanager
def _server(env: dict[str, str]) -> Iterator[Any]:
    with serve_subprocess("--port", "0", "--devices", "cpu", log_level="WARNING", env=env) as server:
        yield server


def run(*, seed: int, seconds: float, max_calls: int = 0, only: list[str] | None = None,
        check_every: int = 20, quota_bytes: int = 256 << 20, op_deadline: float = 5.0, log: Any = None,
        repeat: bool = False, graphs: bool = False) -> Report:
    """Fuzz for ``seconds`` (or ``max_calls``) against a fresh server process; return the report.

    ``repeat``: send every command that ran cleanly twice more in one batch, so the session runs it by its
    command plan (natively where the server's runner covers it) over storages the first run may have
    written, resized or freed.

    ``graphs``: send every other call as a one-node graph and its replay (:func:`as_graph`).

    ``op_deadline`` is the server's: an op that runs longer (an SVD of a broadcast 8192 x 65536
    matrix within the element limit takes minutes) gets its session's worker killed, which the
    report counts as a session loss, as the node does for any client.
    """
    rng = random.Random(seed)
    report = Report()
    ops = fuzzable_ops(only)
    if not ops:
        raise ValueError(f"no allowed op to fuzz (asked for {only})")
    env = {"GENIE_MAX_SESSION_BYTES": str(quota_bytes), "GENIE_OP_DEADLINE": str(op_deadline)}
    started = time.monotonic()
    deadline = started + seconds
    while time.monotonic() < deadline and (not max_calls or report.calls < max_calls):
        with _server(env) as server:
            bystander = _Session(server.port, {1: _BYSTANDER})
            attacker = _Session(server.port, _BASE)
            try:
                while time.monotonic() < deadline and (not max_calls or report.calls < max_calls):
                    name, schema = rng.choice(ops)
                    cmd = _call(rng, name, schema)
                    report.ops.add(name)
                    report.calls += 1
                    began = time.monotonic()
                    try:
                        c = attacker.client
                        if graphs and report.calls % 2 == 0:
                            report.graph_calls += 1
                            define, run_it = as_graph(cmd, name, c.next_req(), report.calls)
                            reply = c.request([define])
                            if reply.error is None:
                                reply = c.request([run_it, sync(c.next_req())])
                        else:
                            reply = c.request([cmd, sync(c.next_req())])
                        report.errors += bool(reply.deferred or reply.error)
                        replies = [reply]
                        if repeat and not (reply.deferred or reply.error):
                            replies.append(attacker.client.request([cmd, cmd, sync(attacker.client.next_req())]))
                            report.calls += 2
                        for record in [r for one in replies for r in [*one.deferred, *([one.error] if one.error else [])]]:
                            if leaked_word(str(record.get("message", ""))):
                                report.leaks.append(f"{name}: {record['message'][:300]}")
                    except (GenieError, OSError, AssertionError) as exc:
                        if not server.alive():
                            report.deaths.append(f"{name}: {cmd!r:.300}")
                            if log:
                                log(f"server died on {name} (call {report.calls}): {server.log()[-2000:]}")
                            break
                        report.session_losses += 1
                        report.losses.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
                        if log:
                            log(f"session lost on {name} (call {report.calls}, {cmd!r:.400}): {server.log()[-1500:]}")
                        attacker.close()
                        try:
                            attacker = _Session(server.port, _BASE)
                        except (GenieError, OSError, AssertionError) as again:
                            # Busy with a slow op of the lost session, or dying (its listener is gone): start afresh.
                            with contextlib.suppress(AssertionError):
                                wait_until(lambda: not server.alive(), timeout=2.0, what="the server to exit")
                            if not server.alive():
                                report.deaths.append(f"{name}: {cmd!r:.300}")
                            else:
                                report.losses.append(f"reconnect after {name}: {type(again).__name__}: {again}"[:300])
                            break
                    if log and time.monotonic() - began > 10:
                        log(f"slow call: {name} took {time.monotonic() - began:.1f} s: {cmd!r:.400}")
                    report.slowest = sorted([*report.slowest, (time.monotonic() - began, name)], reverse=True)[:5]
                    if report.calls % check_every == 0:
                        _check_bystander(bystander, report)
                    if report.calls % FRESH_EVERY == 0:
                        # In-place ops (resize_, set_) change the fuzzer's storages until every descriptor fails its
                        # bounds check: a fresh session gets fresh ones.
                        attacker.close()
                        attacker = _Session(server.port, _BASE)
                if server.alive():
                    _check_bystander(bystander, report)
            finally:
                attacker.close()
                bystander.close()
    report.seconds = time.monotonic() - started
    return report


def _check_bystander(bystander: _Session, report: Report) -> None:
    report.bystander_checks += 1
    try:
        got = bystander.client.fetch(1, _BYSTANDER)
    except (GenieError, OSError, AssertionError) as exc:
        report.bystander_failures.append(f"fetch failed: {exc}")
        return
    if not torch.equal(got, _BYSTANDER):
        report.bystander_failures.append("the bystander's tensor changed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=900.0, help="how long to run (default 900)")
    parser.add_argument("--seed", type=int, default=int(time.time()), help="random seed (default: the time)")
    parser.add_argument("--calls", type=int, default=0, help="stop after this many calls (default: no limit)")
    parser.add_argument("--op", action="append", help="fuzz only this op (repeatable)")
    parser.add_argument("--repeat", action="store_true",
                        help="send each command that ran cleanly twice more, so it runs by its command plan")
    parser.add_argument("--graphs", action="store_true",
                        help="send every other call as a one-node graph (GRAPH + REPLAY): fuzz the replay gate too")
    opts = parser.parse_args(argv)
    print(f"seed {opts.seed}", flush=True)
    report = run(seed=opts.seed, seconds=opts.seconds, max_calls=opts.calls, only=opts.op,
                 log=lambda text: print(text, file=sys.stderr, flush=True), repeat=opts.repeat, graphs=opts.graphs)
    print(report.summary())
    for death in report.deaths:
        print("DEATH", death)
    for loss in report.losses:
        print("SESSION LOST", loss)
    print("slowest calls:", ", ".join(f"{name} {t:.2f} s" for t, name in report.slowest))
    for failure in report.bystander_failures:
        print("BYSTANDER", failure)
    for leak in report.leaks:
        print("LEAK", leak)
    return 1 if report.deaths or report.bystander_failures or report.leaks else 0


if __name__ == "__main__":
    sys.exit(main())
