"""Command plans (genie/server/plans.py): a repeated op signature runs by a plan, with the same results and
the same errors as the full path; anything a plan does not cover falls back.

The walker (genie._C_keys.command_key) is tested on bytes; the plan path end to end on a real in-process
server (sessions in threads, so the session's count of plan runs can be read) over loopback TCP with the
raw wire client. "The full path" of a command is obtained by sending it as the first of its signature
in a fresh session with the same storages: its error record must equal the plan path's.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import pytest
import torch

from genie._C_keys import command_key
from genie.server import DataPlaneServer, codec, plans
from genie.wire.values import EXT_TENSOR, inline_tensor
from tests.raw_client import RawClient, T, call, desc, free, op, seed, sync
from tests.raw_client import fetch as raw_fetch

F = torch.empty(1)  # one float32: the layout of most commands below


def _add(src: int, dst: int, scalar: Any = 1, like: torch.Tensor = F) -> bytes:
    return op("aten::add.Tensor", [T(src, like), scalar], {}, [T(dst, like)])


def key(data: bytes) -> tuple[bytes, tuple[int, ...]]:
    """The command's key and ids (the test fails when it cannot be keyed)."""
    found = command_key(data)
    assert found is not None
    return found[0], found[1]


def floats(data: bytes) -> tuple[float, ...]:
    found = command_key(data)
    assert found is not None
    return found[2]


# -- the walker -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), [(5, 6), (200, 70_000), (1 << 40, (1 << 63) - 1)])
def test_keys_equal_when_only_the_storage_ids_differ(a: int, b: int) -> None:
    key1, ids1 = key(_add(1, 2))
    key2, ids2 = key(_add(a, b))
    assert key1 == key2 and ids1 == (1, 2) and ids2 == (a, b)


def test_keys_differ_on_scalars_layouts_ops_and_aliasing() -> None:
    base = key(_add(1, 2))[0]
    assert key(_add(1, 2, 2))[0] != base
    assert key(_add(1, 2, 1.0))[0] != base
    assert key(_add(1, 2, like=torch.empty(2)))[0] != base
    assert key(op("aten::sub.Tensor", [T(1, F), 1], {}, [T(2, F)]))[0] != base
    assert key(_add(3, 3))[0] != base  # the output aliases the input
    assert key(_add(0, 2))[0] != base  # storage 0 is the empty storage, never a slot


def test_floats_are_taken_out_of_the_key_in_order_keeping_their_type() -> None:
    """An optimizer's step size changes every step: its commands keep one key, the floats come apart."""
    assert key(_add(1, 2, 1.5))[0] == key(_add(7, 8, -2.25e-3))[0]
    assert floats(_add(1, 2, 1.5)) == (1.5,) and floats(_add(1, 2)) == ()
    addcdiv = op("aten::addcdiv_", [T(1, F), T(2, F), T(3, F)], {"value": -0.001}, [T(1, F)])
    assert floats(addcdiv) == (-0.001,)
    scalars = op("aten::_foreach_add_.ScalarList", [[T(1, F), T(2, F)], [0.5, 2.0]], {}, [None])
    assert floats(scalars) == (0.5, 2.0)
    as_float32 = _add(1, 2, 1.5).replace(b"\xcb" + struct.pack(">d", 1.5), b"\xca" + struct.pack(">f", 1.5))
    assert key(as_float32)[0] != key(_add(1, 2, 1.5))[0] and floats(as_float32) == (1.5,)


def test_a_calls_request_and_output_ids_are_taken_out_of_its_key() -> None:
    s = torch.empty(())
    key1, ids1 = key(call(1, "aten::mul.Tensor", [T(1, s), T(2, s)], outs=[3]))
    key2, ids2 = key(call(900, "aten::mul.Tensor", [T(7, s), T(8, s)], outs=[70_000]))
    assert key1 == key2 and ids1 == (1, 1, 2, 3) and ids2 == (900, 7, 8, 70_000)
    # A request id equal to a storage id is no aliasing; two equal storage ids are.
    assert key(call(8, "aten::mul.Tensor", [T(7, s), T(8, s)], outs=[9]))[0] == key1
    assert key(call(5, "aten::mul.Tensor", [T(7, s), T(7, s)], outs=[9]))[0] != key1
    assert command_key(call(-1, "aten::mul.Tensor", [T(7, s), T(8, s)], outs=[9])) is None  # not a request id


def test_unkeyable_bytes_give_none() -> None:
    good = _add(1, 2)
    assert command_key(good[:-1]) is None  # truncated
    assert command_key(good + b"\x00") is None  # trailing bytes
    assert command_key(b"\xc1") is None  # the byte msgpack never uses
    assert command_key(b"\xdd\xff\xff\xff\xff") is None  # a count beyond the bytes
    assert command_key(b"\x91" * 100 + b"\x00") is None  # nested deeper than the walker goes
    assert command_key(msgpack.packb([1, inline_tensor(torch.ones(2))])) is None  # inline tensors are values
    negative_id = msgpack.packb([msgpack.ExtType(EXT_TENSOR, msgpack.packb([-1, 0, [1], [1], 0, 4]))])
    assert command_key(negative_id) is None
    with pytest.raises(TypeError):
        command_key("not bytes")  # type: ignore[arg-type]


def _unblanked(data: bytes) -> Any:
    """The decoded command with every descriptor's id set to 0 (what a key stands for, ids aside)."""
    def walk(value: Any) -> Any:
        if type(value) is codec.Descriptor:
            return ("T", value.dtype, value.sizes, value.strides, value.offset, value.storage_nbytes)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if type(value) is float:
            return (float, "taken out of the key")
        return (type(value), value)
    return walk(codec.decode(data))


def test_equal_keys_mean_equal_commands_but_for_ids_on_mutated_bytes() -> None:
    """Random byte flips of real commands: whenever two keyable variants share a key, they decode to the
    same command once ids are set aside (the property the plan cache rests on)."""
    rng = random.Random(7)
    seeds = [_add(1, 2), _add(300, 70_000, 2.5), op("aten::cat", [[T(1, F), T(2, F)], 0], {}, [T(3, torch.empty(2))]),
             op("aten::mul.Tensor", [T(4, F)], {"other": T(5, F)}, [T(6, F)])]
    seen: dict[bytes, Any] = {}
    for _ in range(4000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        keyed = command_key(bytes(data))
        if keyed is None:
            continue
        try:
            decoded = _unblanked(bytes(data))
        except Exception:  # noqa: BLE001 - bytes the full path refuses: never planned, nothing to compare
            continue
        if keyed[0] in seen:
            assert seen[keyed[0]] == decoded
        else:
            seen[keyed[0]] = decoded


# -- end to end ------------------------------------------------------------------------------------------


@pytest.fixture(params=["native", "python"])
def server(request: pytest.FixtureRequest, inproc_server: Callable[..., DataPlaneServer],
           monkeypatch: pytest.MonkeyPatch) -> Callable[..., DataPlaneServer]:
    """``server(**options)``: an in-process server with one CPU device, sessions in threads; every test runs
    with plans run by the native runner (genie._C_plans) where they can be, and again with Python's only."""
    if request.param == "python":
        monkeypatch.setattr(plans, "Runner", None)  # sessions opened from now on get no native runner
    return lambda **options: inproc_server(devices=1, isolation="none", **options)


@pytest.fixture
def connect(raw_clients: Callable[[int], RawClient]) -> Callable[[DataPlaneServer], RawClient]:
    """``connect(server)``: a raw client of an in-process server, closed at teardown."""
    return lambda srv: raw_clients(srv.port)


def _planned(srv: DataPlaneServer) -> int:
    return sum(s["planned"] for s in srv.stats()["per_session"].values())


def _native(srv: DataPlaneServer) -> int:
    return sum(s["native"] for s in srv.stats()["per_session"].values())


def _native_mode() -> bool:
    return plans.Runner is not None


def test_a_chain_of_ops_runs_by_its_plan_and_gives_the_same_numbers(server, connect) -> None:
    srv = server()
    c = connect(srv)
    n = 300
    c.send_batch([*(_add(i, i + 1) for i in range(1, n + 1)), free(*range(1, n + 1))],
                 uploads=[(1, 0, torch.tensor([0.5]))])
    assert c.sync().deferred == []
    assert c.fetch(n + 1, F).item() == 0.5 + n
    assert _planned(srv) == n - 1  # the first ran the full path and made the plan
    assert _native(srv) == (n - 1 if _native_mode() else 0)


def test_an_optimizers_changing_scalars_keep_the_plan_and_each_step_uses_its_own(server, connect) -> None:
    """AdamW's step sizes and bias corrections change every step: with the floats out of the key its ops run
    by their plan (natively where the runner can), each with the float its command carries, as a keyword,
    positional, a Scalar where a Tensor goes (x + 0.25) and a list of scalars (_foreach_add_.ScalarList)."""
    srv = server()
    c = connect(srv)
    x = torch.tensor([1.0, -2.0, 4.0])
    steps = [0.5 * (i + 1) for i in range(20)]
    cmds = []
    for i, lr in enumerate(steps):
        cmds += [op("aten::add_.Tensor", [T(1, x), T(2, x)], {"alpha": -lr}, [T(1, x)]),
                 op("aten::mul.Scalar", [T(1, x), lr], {}, [T(100 + i, x)]),
                 op("aten::add.Tensor", [T(100 + i, x), lr / 4], {}, [T(200 + i, x)]),
                 op("aten::_foreach_add_.ScalarList", [[T(3, x), T(4, x)], [lr, -lr]], {}, [None])]
    c.send_batch(cmds, uploads=[(1, 0, x), (2, 0, torch.ones(3)), (3, 0, x), (4, 0, x)])
    assert c.sync().deferred == []
    expect, a, b = x.clone(), x.clone(), x.clone()
    for i, lr in enumerate(steps):
        expect.add_(torch.ones(3), alpha=-lr)
        torch.testing.assert_close(c.fetch(200 + i, x), expect * lr + lr / 4)
        a += lr
        b -= lr
    torch.testing.assert_close(c.fetch(1, x), expect)
    torch.testing.assert_close(c.fetch(3, x), a)
    torch.testing.assert_close(c.fetch(4, x), b)
    assert _planned(srv) == 4 * (len(steps) - 1)  # each signature's first command made its plan
    # _foreach_add_'s tensor list leaves it to the Python plan; the other three run natively
    assert _native(srv) == (3 * (len(steps) - 1) if _native_mode() else 0)


def test_floats_that_decide_the_output_shape_run_by_a_plan_only_for_the_same_values(server, connect) -> None:
    """Upsampling's scale factor decides the output's length: a plan checked for 2.0 (8 elements) is not used
    for 3.0 (12); the full path checks that one, so the quota and the descriptor checks see every length."""
    srv = server()
    c = connect(srv)
    x = torch.arange(4.0).reshape(1, 1, 4)

    def upsample(scale: float, storage_id: int) -> bytes:
        out = torch.nn.functional.interpolate(x, scale_factor=scale)
        return op("aten::upsample_nearest1d.vec", [T(1, x), None, [scale]], {}, [T(storage_id, out)])

    c.send_batch([upsample(2.0, 2), upsample(2.0, 3), upsample(3.0, 4)], uploads=[(1, 0, x)])
    assert c.sync().deferred == []
    for storage_id, scale in ((3, 2.0), (4, 3.0)):
        expect = torch.nn.functional.interpolate(x, scale_factor=scale)
        assert torch.equal(c.fetch(storage_id, expect), expect)
    assert _planned(srv) == 1  # only the second command, with the first one's end


def test_ops_run_by_plan_are_counted_in_the_sessions_metrics(server, connect) -> None:
    """The native runner records each op as SessionMetrics.record_op does (it skips the Python call for names
    the session counted before): one count per op, one latency observation per op."""
    srv = server()
    c = connect(srv)
    n = 50
    c.send_batch([*(_add(i, i + 1) for i in range(1, n + 1)), free(*range(1, n + 1))],
                 uploads=[(1, 0, torch.tensor([0.5]))])
    assert c.sync().deferred == []
    (metrics,) = srv.metrics.sessions()
    ops = {op: count for (op, status), count in metrics.tally.ops.items() if status == "ok"}
    assert ops.get("aten::add.Tensor") == n, ops
    assert metrics.tally.latency["ok"].count == sum(ops.values())
    assert 0 < metrics.tally.latency["ok"].sum < 60


def test_in_place_view_and_list_ops_by_plan_match_the_full_path(server, connect) -> None:
    """A list of tensors (cat's) runs by plan too, natively where the runner was built (a decode step's KV
    cache grows by cat: 24 commands a token of a 12-layer GPT-2 ran by Python's plan before)."""
    x = torch.arange(6.0).reshape(2, 3)
    cmds = []
    for i in range(3):  # the same signatures three times over new storages
        a, b, s = 10 * i + 1, 10 * i + 2, 10 * i + 4
        cmds += [op("aten::add_.Tensor", [T(a, x), T(b, x)], {"alpha": 2}, [T(a, x)]),
                 op("aten::view", [T(a, x), [3, 2]], {}, [T(a, x.view(3, 2))]),
                 op("aten::cat", [[T(a, x), T(b, x)], 1], {}, [T(s, torch.cat([x, x], 1))])]
    uploads = [(10 * i + k, 0, x + k + i) for i in range(3) for k in (1, 2)]
    (got, planned, native), (_, cold, _) = _by_plan_and_full_path(
        server, connect, cmds, uploads, lambda c: [c.fetch(21, x), c.fetch(24, torch.cat([x, x], 1))])
    assert planned > 0 and cold == 0
    if _native_mode():
        assert native == planned == 6  # add_, view, cat of the second and third rounds
    want_a = (x + 1 + 2) + 2 * (x + 2 + 2)
    torch.testing.assert_close(got[0], want_a, rtol=0, atol=0)


def _by_plan_and_full_path(server, connect, cmds: list[bytes], uploads: Sequence[tuple[Any, ...]],
                           fetch: Callable[[RawClient], list[torch.Tensor]]) -> list[tuple[list[torch.Tensor], int, int]]:
    """Three rounds of the same signatures (``cmds``) in one session, and the last round alone in a fresh one (the
    full path): per session, ``fetch(client)``'s tensors (equal in both) and the commands run by plan and natively."""
    out = []
    for warm in (True, False):
        srv = server()
        c = connect(srv)
        c.send_batch(cmds if warm else cmds[2 * len(cmds) // 3:], uploads=uploads)
        assert c.sync().deferred == []
        out.append((fetch(c), _planned(srv), _native(srv)))
    for got, full in zip(out[0][0], out[1][0], strict=True):
        assert torch.equal(got, full)
    return out


def _compare(server, connect, warm: list[bytes], setup: list[bytes], failing: bytes,
             uploads: Sequence[tuple[Any, ...]] = (), by_plan: bool = False, **options: Any) -> list[Any]:
    """Run ``failing`` after ``setup`` (with ``uploads``) in two sessions: one where ``warm`` made its plan
    first (over storages 1 to 4, then freed: both sessions hold the same), one where it is the first of its
    signature. The deferred errors must be equal. ``by_plan``: whether the failing command passes the
    plan's checks (it fails in its kernel) rather than falling back before it. Returns the errors."""
    got = []
    for with_plan in (True, False):
        srv = server(**options)
        c = connect(srv)
        if with_plan:
            c.send_batch([*warm, free(1, 2, 3, 4)], uploads=[(n, 0, t) for n, t in warm_uploads(warm)])
            assert c.sync().deferred == []
        c.send_batch(setup, uploads=uploads)
        assert c.sync().deferred == []
        before = _planned(srv)
        c.send_batch([failing])
        got.append(c.sync().deferred)
        assert (_planned(srv) > before) == (with_plan and by_plan)
    assert got[0] == got[1] and got[0], got
    return got[0]


def warm_uploads(warm: list[bytes]) -> list[tuple[int, torch.Tensor]]:
    """The warm-up commands' inputs (storages 1 and 2), as the first descriptor of each command says."""
    out = {}
    for data in warm:
        for value in codec.decode(data)[3]:
            if type(value) is codec.Descriptor and value.storage_id in (1, 2):
                out[value.storage_id] = torch.ones(value.sizes, dtype=value.dtype)
    return sorted(out.items())


def test_commands_naming_the_empty_storage_run_by_plan_as_on_the_full_path(server, connect) -> None:
    """Storage 0 is the empty storage (``torch.tensor([])``): Hugging Face's KV cache starts so, and a GPT-2
    training step cats onto it and zero_s it (its gradient) in every layer, 48 commands a step of GPT-2 small that
    all took the full path. Its place is fixed by the key: by Python's plan, a new empty tensor each time, an
    empty output never kept, and the same results as the full path."""
    x, empty = torch.arange(6.0).reshape(2, 3), torch.empty(0, 3)
    cmds = []
    for i in range(3):  # the same signatures three times over new storages
        a, out = 10 * i + 1, 10 * i + 2
        cmds += [op("aten::cat", [[T(0, empty), T(a, x)], 0], {}, [T(out, x)]),
                 op("aten::zero_", [T(0, empty)], {}, [T(0, empty)]),
                 op("aten::add_.Tensor", [T(a, x), T(out, x)], {}, [T(a, x)])]
    uploads = [(10 * i + 1, 0, x + i) for i in range(3)]
    (got, planned, _), (_, cold, _) = _by_plan_and_full_path(server, connect, cmds, uploads,
                                                             lambda c: [c.fetch(22, x), c.fetch(21, x)])
    assert (planned, cold) == (6, 0)  # cat, zero_, add_ of the second and third rounds
    torch.testing.assert_close(got[0], x + 2, rtol=0, atol=0)
    torch.testing.assert_close(got[1], 2 * (x + 2), rtol=0, atol=0)


def test_an_in_place_op_into_a_storage_made_on_first_use_runs_by_its_plan(server, connect) -> None:
    """The client makes a tensor without a command (``x.to(torch.bfloat16)``: an empty tensor, then a copy_
    into it; ``torch.full``: fill_): its storage is made, zero-filled, by its first command. Every such copy_
    after the first runs by the plan (it took the full path each time before: over 500 commands of a GPT-2
    training step under autocast), with the full path's result."""
    srv = server()
    c = connect(srv)
    n = 40
    src = torch.tensor([1.5, -2.25, 3.0])
    half = src.to(torch.bfloat16)
    c.send_batch([op("aten::copy_", [T(i + 1, half), T(1, src)], {}, [T(i + 1, half)]) for i in range(1, n + 1)],
                 uploads=[(1, 0, src)])
    assert c.sync().deferred == []
    for i in (2, n + 1):
        assert torch.equal(c.fetch(i, half), half)
    assert _planned(srv) == n - 1
    assert _native(srv) == (n - 1 if _native_mode() else 0)  # the native runner makes the storage too


def test_a_first_use_past_the_byte_quota_fails_as_on_the_full_path(server, connect) -> None:
    """Making a storage on first use counts against the session's bytes as the full path's make does: past
    the quota the command falls back, and the full path records the quota error."""
    src = torch.zeros(64)
    copy = op("aten::copy_", [T(5, src), T(6, src)], {}, [T(5, src)])
    warm = [op("aten::copy_", [T(1, src), T(2, src)], {}, [T(1, src)])]
    errors = _compare(server, connect, warm, [], copy, uploads=[(6, 0, src), (7, 0, torch.zeros(150))],
                      max_session_bytes=1000)
    assert errors[0]["kind"] == "quota" and "max_session_bytes" in errors[0]["message"], errors


def test_dropout_runs_by_its_plan_drawing_from_the_sessions_generator_as_the_full_path(server, connect) -> None:
    """native_dropout has no generator argument: the full path draws from the session's generator of the device,
    and so does its plan (bound at build, reseeded in place by CMD_SEED). After a reseed, the same draws come
    back whether the full path or the plan ran them; the plan is never the native runner's."""
    x = torch.arange(1.0, 65.0)

    def dropouts(first: int) -> list[bytes]:
        return [op("aten::native_dropout", [T(1, x), 0.5, True], {},
                   [T(first + 2 * i, x), T(first + 2 * i + 1, x.bool())]) for i in range(3)]

    srv = server()
    c = connect(srv)
    c.send_batch([seed(0, 0, 1234), *dropouts(10), seed(0, 0, 1234), *dropouts(20)], uploads=[(1, 0, x)])
    assert c.sync().deferred == []
    first = [c.fetch(10 + i, x) for i in range(0, 6, 2)]
    again = [c.fetch(20 + i, x) for i in range(0, 6, 2)]
    assert _planned(srv) == 5 and _native(srv) == 0  # all but the first by the plan, none natively
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
        assert set(a.unique().tolist()) <= {0.0, *(2 * x).tolist()}
    assert not torch.equal(first[0], first[1])  # each draw moves the generator on


def test_a_first_use_of_a_freed_storage_by_plan_fails_as_on_the_full_path(server, connect) -> None:
    src = torch.tensor([1.5, -2.25, 3.0])
    copy = op("aten::copy_", [T(5, src), T(6, src)], {}, [T(5, src)])
    warm = [op("aten::copy_", [T(1, src), T(2, src)], {}, [T(1, src)])]
    errors = _compare(server, connect, warm, [free(5)], copy, uploads=[(5, 0, src), (6, 0, src)])
    assert errors[0]["kind"] == "storage" and "freed" in errors[0]["message"]


def test_a_freed_input_fails_as_on_the_full_path(server, connect) -> None:
    errors = _compare(server, connect, [_add(1, 2)], [free(5)], _add(5, 6), uploads=[(5, 0, F)])
    assert errors[0]["kind"] == "storage" and "freed" in errors[0]["message"]


def test_a_poisoned_input_fails_as_on_the_full_path(server, connect) -> None:
    errors = []
    for with_plan in (True, False):
        srv = server()
        c = connect(srv)
        c.send_batch([*([_add(1, 2)] if with_plan else []),  # then an op whose shapes disagree poisons 5
                      op("aten::add.Tensor", [T(1, F), T(3, torch.empty(2))], {}, [T(5, F)])],
                     uploads=[(1, 0, F), (3, 0, torch.ones(2))])
        first = c.sync().deferred
        assert first and first[0]["storages"] == [5]
        c.send_batch([_add(5, 6)])
        errors.append(c.sync().deferred)
    assert errors[0] == errors[1] and "earlier command failed" in errors[0][0]["message"]


def test_an_input_of_another_size_fails_as_on_the_full_path(server, connect) -> None:
    errors = _compare(server, connect, [_add(1, 2)], [], _add(5, 6), uploads=[(5, 0, torch.ones(2))])
    assert errors[0]["kind"] == "storage" and "CMD_RESIZE" in errors[0]["message"]


def test_an_out_of_bounds_descriptor_fails_as_on_the_full_path(server, connect) -> None:
    beyond = [5, 0, [1], [1], 3, 4]  # element 3 of a 4-byte storage
    failing = op("aten::add.Tensor", [T(beyond), 1], {}, [T(6, F)])
    errors = _compare(server, connect, [_add(1, 2)], [], failing, uploads=[(5, 0, F)])
    assert errors[0]["kind"] == "protocol" and "reaches byte" in errors[0]["message"]


def test_the_byte_quota_is_checked_per_command_on_the_plan_path(server, connect) -> None:
    big = torch.empty(1024)  # 4096 bytes
    errors = []
    for with_plan in (True, False):
        srv = server(max_session_bytes=4096 * 3 - 1)
        c = connect(srv)
        if with_plan:  # the plan is made while there is room, and its output freed again
            c.send_batch([_add(1, 2, like=big), free(1, 2)], uploads=[(1, 0, big)])
            assert c.sync().deferred == []
        c.send_batch([], uploads=[(5, 0, big), (7, 0, big)])  # 8192 of 12287 bytes: no room for 4096 more
        c.send_batch([_add(5, 6, like=big)])
        errors.append(c.sync().deferred)
    assert errors[0] == errors[1] and errors[0][0]["kind"] == "quota"


def test_the_storage_count_quota_is_checked_per_command(server, connect) -> None:
    uploads = [(5, 0, F), (8, 0, F), (9, 0, F)]
    errors = _compare(server, connect, [_add(1, 2)], [], _add(5, 6), uploads=uploads, max_session_handles=3)
    assert errors[0]["kind"] == "quota"


def test_a_kernel_failure_on_the_plan_path_is_recorded_as_on_the_full_path(server, connect) -> None:
    i = torch.ones(1, dtype=torch.int64)

    def div(a: int, b: int, out: int) -> bytes:
        return op("aten::div.Tensor_mode", [T(a, i), T(b, i)], {"rounding_mode": "floor"}, [T(out, i)])

    errors = _compare(server, connect, [div(1, 2, 3)], [], div(5, 6, 7), by_plan=True,
                      uploads=[(5, 0, i), (6, 0, torch.zeros(1, dtype=torch.int64))])
    assert errors[0]["kind"] == "execution" and errors[0]["storages"] == [7]


def test_an_output_into_a_known_storage_is_copied_by_the_full_rule(server, connect) -> None:
    srv = server()
    c = connect(srv)
    c.send_batch([_add(1, 2), _add(5, 6)], uploads=[(1, 0, F), (5, 0, torch.tensor([3.0])),
                                                       (6, 0, torch.tensor([9.0]))])
    assert c.sync().deferred == []
    assert _planned(srv) == 1
    assert c.fetch(6, F).item() == 4.0  # copied into the existing storage 6, as the full rule does


def test_an_output_into_a_known_storage_of_another_size_fails_as_on_the_full_path(server, connect) -> None:
    errors = _compare(server, connect, [_add(1, 2)], [], _add(5, 6), by_plan=True,
                      uploads=[(5, 0, F), (6, 0, torch.ones(2))])  # storage 6 holds 8 bytes, described as 4
    assert errors[0]["kind"] == "storage" and errors[0]["storages"] == [6]


def test_a_command_that_failed_makes_no_plan(server, connect) -> None:
    x = torch.empty(2, 3)

    def view(storage_id: int) -> bytes:  # the view's storage is the input's, described with another layout
        return op("aten::view", [T(storage_id, x), [3, 2]], {}, [T([storage_id, 0, [3, 2], [1, 3], 0, 24])])

    srv = server()
    c = connect(srv)
    c.send_batch([view(1), view(5)], uploads=[(1, 0, x), (5, 0, x)])
    errors = c.sync().deferred
    assert [e["kind"] for e in errors] == ["mismatch", "mismatch"] and _planned(srv) == 0


def test_a_new_scalar_misses_the_plan_and_runs_the_full_path(server, connect) -> None:
    srv = server()
    c = connect(srv)
    c.send_batch([_add(1, 2), _add(2, 3, 2), _add(3, 4, 3.5)], uploads=[(1, 0, torch.zeros(1))])
    assert c.sync().deferred == []
    assert _planned(srv) == 0
    assert c.fetch(4, F).item() == 6.5
    c.send_batch([_add(4, 5, 3.5), sync(c.next_req())])
    c.reply()
    assert _planned(srv) == 1


def _add_out(src: int, dst: int) -> bytes:
    """``aten::add.out`` with its out argument and output over ``dst``, as the device client sends structured ops."""
    return op("aten::add.out", [T(src, F), 1], {"out": T(dst, F)}, [T(dst, F)])


def test_an_out_op_with_fresh_outputs_runs_its_functional_form_by_plan(server, connect) -> None:
    srv = server()
    c = connect(srv)
    n = 50
    c.send_batch([_add_out(i, i + 1) for i in range(1, n + 1)], uploads=[(1, 0, torch.tensor([2.0]))])
    assert c.sync().deferred == []
    assert c.fetch(n + 1, F).item() == 2.0 + n and _planned(srv) == n - 1
    assert _native(srv) == (n - 1 if _native_mode() else 0)


def test_an_out_op_into_a_known_storage_falls_back_and_writes_it(server, connect) -> None:
    srv = server()
    c = connect(srv)
    c.send_batch([_add_out(1, 2), _add_out(2, 3)], uploads=[(1, 0, torch.tensor([2.0])), (3, 0, F)])
    assert c.sync().deferred == [] and _planned(srv) == 0  # storage 3 exists: the out= form writes into it
    assert c.fetch(3, F).item() == 4.0


def test_an_out_op_into_a_freed_storage_fails_as_on_the_full_path(server, connect) -> None:
    errors = _compare(server, connect, [_add_out(1, 2)], [free(6)], _add_out(5, 6), uploads=[(5, 0, F), (6, 0, F)])
    assert errors[0]["kind"] == "storage" and "freed" in errors[0]["message"]


def test_calls_run_by_their_plan_and_answer_as_the_full_path(server, connect) -> None:
    s = torch.empty(())
    srv = server()
    c = connect(srv)
    c.send_batch([], uploads=[(1, 0, torch.tensor(1.5)), (2, 0, torch.tensor(-4.0))])
    got = [c.request([call(c.next_req(), "aten::_local_scalar_dense.default", [T(sid, s)])]).result
           for sid in (1, 2, 1)]
    assert got == [1.5, -4.0, 1.5] and _planned(srv) == 2
    r = c.request([call(c.next_req(), "aten::mul.Tensor", [T(1, s), T(2, s)], outs=[5])])
    r2 = c.request([call(c.next_req(), "aten::mul.Tensor", [T(2, s), T(5, s)], outs=[6])])
    assert r.error is None and r2.error is None and r2.result[0] == 6 and _planned(srv) == 3
    assert c.fetch(6, s).item() == 24.0
    c.request([call(c.next_req(), "aten::mul.Tensor", [T(2, s), T(2, s)], outs=[7])])  # aliased: another key
    assert _planned(srv) == 3 and c.fetch(7, s).item() == 16.0


def test_a_call_failing_in_its_kernel_by_plan_answers_as_the_full_path(server, connect) -> None:
    i = torch.ones((), dtype=torch.int64)

    def div(c: RawClient, a: int, b: int, out: int) -> Any:
        return c.request([call(c.next_req(), "aten::div.Tensor_mode", [T(a, i), T(b, i)],
                               {"rounding_mode": "floor"}, outs=[out])])

    answers = []
    for with_plan in (True, False):
        srv = server()
        c = connect(srv)
        c.send_batch([], uploads=[(1, 0, i), (2, 0, i), (5, 0, i), (6, 0, torch.zeros((), dtype=torch.int64))])
        if with_plan:
            assert div(c, 1, 2, 3).error is None
        answers.append(div(c, 5, 6, 7).error)
        assert _planned(srv) == int(with_plan)
        c.send_batch([_add(7, 8, like=torch.empty((), dtype=torch.int64))])  # the failed output is poisoned
        assert "earlier command failed" in c.sync().deferred[0]["message"]
    assert answers[0] == answers[1] and answers[0]["kind"] == "execution"


def _batch_norm(name: str, inputs: Sequence[torch.Tensor], outs: list[torch.Tensor], base: int, mean: int = 4) -> bytes:
    """A training batch norm ``name`` of x, weight, bias (storages 1 to 3), running mean (``mean``, laid out as
    ``inputs[3]`` when given, else as bias) and var (5) into outputs ``base`` onwards."""
    x, weight, bias = inputs[:3]
    like_mean = inputs[3] if len(inputs) > 3 else bias
    return op(name, [T(1, x), T(2, weight), T(3, bias), T(mean, like_mean), T(5, bias), True, 0.1, 1e-5],
              {}, [T(base + k, o) for k, o in enumerate(outs)])


def _three_batch_norms(server: Callable[..., DataPlaneServer], connect: Callable[[DataPlaneServer], RawClient],
                       name: str, outs: list[torch.Tensor]) -> tuple[DataPlaneServer, RawClient, tuple[Any, ...]]:
    """A session that ran three batch norms ``name`` (outputs 10, 20, 30 onwards): its server, client, inputs."""
    inputs = (torch.randn(4, 3, 5), torch.rand(3) + 0.5, torch.randn(3))
    srv = server()
    c = connect(srv)
    c.send_batch([_batch_norm(name, inputs, outs, base) for base in (10, 20, 30)],
                 uploads=[(1, 0, inputs[0]), (2, 0, inputs[1]), (3, 0, inputs[2]), (4, 0, torch.zeros(3)),
                          (5, 0, torch.ones(3))])
    assert c.sync().deferred == []
    return srv, c, inputs


def test_an_op_the_device_runs_by_decomposition_leaves_the_native_runner_for_python(server, connect) -> None:
    """aten::cudnn_batch_norm has no CPU kernel: by plan the native runner finds that out before anything
    ran and Python's plan runs torch's decomposition, then and every later time; the numbers match."""
    name = "aten::cudnn_batch_norm"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")  # the premise of this test
    outs = [torch.empty(4, 3, 5), torch.empty(3), torch.empty(3), torch.empty(0, dtype=torch.uint8)]
    srv, c, (x, weight, bias) = _three_batch_norms(server, connect, name, outs)
    assert _planned(srv) == 2 and _native(srv) == 0
    expected = torch.nn.functional.batch_norm(x, torch.zeros(3), torch.ones(3), weight, bias, True, 0.1, 1e-5)
    for base in (10, 20, 30):
        torch.testing.assert_close(c.fetch(base, outs[0]), expected)


def test_batch_norm_runs_natively_by_plan_and_a_per_channel_tensor_of_the_wrong_size_is_still_refused(
        server, connect) -> None:
    """native_batch_norm's validator reads only shapes the plan's key fixes (validators.KEY_FIXED): its plan skips
    it and runs in C++ (a ResNet step's 104 batch-norm commands had all run by Python's plan). The running
    statistics update in place as torch's; a running_mean of 1 element for 3 channels (another key) still meets
    the check on the full path, and the session goes on."""
    name = "aten::native_batch_norm"
    outs = [torch.empty(4, 3, 5), torch.empty(3), torch.empty(3)]
    srv, c, (x, weight, bias) = _three_batch_norms(server, connect, name, outs)
    assert _planned(srv) == 2 and _native(srv) == (2 if _native_mode() else 0)
    mean, var = torch.zeros(3), torch.ones(3)
    for base in (10, 20, 30):
        expected = torch.native_batch_norm(x, weight, bias, mean, var, True, 0.1, 1e-5)[0]
        torch.testing.assert_close(c.fetch(base, outs[0]), expected)
    torch.testing.assert_close(c.fetch(4, bias), mean)
    torch.testing.assert_close(c.fetch(5, bias), var)
    c.send_batch([_batch_norm(name, (x, weight, bias, torch.empty(1)), outs, 40, mean=6)],
                 uploads=[(6, 0, torch.zeros(1))])
    errors = c.sync().deferred
    assert len(errors) == 1 and "per-channel tensor of shape [1] for 3 channels" in errors[0]["message"], errors
    torch.testing.assert_close(c.fetch(4, bias), mean)  # the refused command changed nothing


def test_the_native_runner_keeps_the_op_clock_of_a_session_worker() -> None:
    """While a kernel runs by a native plan the worker's op clock names it (the node's supervisor kills a
    worker whose op runs past op_deadline by it); between ops the clock reads idle."""
    import threading

    from genie.server.executor import Executor
    from genie.server.isolation.clock import NULL_CLOCK, OpClock
    from genie.server.store import StorageStore
    from genie.wire.frame import FrameHeader, MsgKind
    from tests.raw_client import pack_body
    from tests.transport.transport_fakes import FakeChannel

    if plans.Runner is None:
        pytest.skip("genie._C_plans was not built")
    clock = OpClock()
    ex = Executor(FakeChannel("test"), StorageStore(), [torch.device("cpu")])
    ex.clock = clock
    x = torch.empty(1200, 1200)
    grad = torch.is_grad_enabled()  # a session's executor turns grad mode off in its thread: this one, here

    def batch(a: int, b: int, out: int) -> tuple[FrameHeader, bytes]:
        body = pack_body({"uploads": [], "cmds": [op("aten::mm", [T(a, x), T(b, x)], {}, [T(out, x)])]})
        return FrameHeader(MsgKind.BATCH, len(body), 0), body

    try:
        ex.store.put(1, torch.rand(1200, 1200).untyped_storage())
        ex.store.put(2, torch.rand(1200, 1200).untyped_storage())
        ex.run_batch(*batch(1, 2, 3))  # the full path makes the plan
        seen: list[tuple[str, float] | None] = []
        runs = [batch(1, 2, 10 + k) for k in range(8)]
        def run_all() -> None:
            for r in runs:
                ex.run_batch(*r)

        worker = threading.Thread(target=run_all)
        worker.start()
        while worker.is_alive():
            seen.append(clock.running())
        worker.join()
        assert ex.native_runs == 8 and not ex.deferred
        assert any(s is not None and s[0] == "aten::mm" for s in seen)  # the kernels run with the GIL released
        assert clock.running() is None
    finally:
        ex.clock = NULL_CLOCK  # the runner forgets the page's address before it is unmapped
        clock.close()
        torch.set_grad_enabled(grad)  # later tests in this process take gradients


def test_random_command_streams_end_the_same_with_and_without_the_native_runner(
        inproc_server: Callable[..., DataPlaneServer], raw_clients: Callable[[int], RawClient],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A differential test: one random stream of ops (outputs mostly into new storages, sometimes into live,
    freed or never-made ones; inputs sometimes freed or poisoned, the poison spreading; in-place, out= and
    CALL commands; frees) goes to a session with the native runner and to one without. Every reply (numbers,
    errors, deferred errors) and every storage's bytes at the end must be equal."""
    rng = random.Random(20261126)
    v, s = torch.empty(4), torch.empty(())
    shapes: dict[int, torch.Tensor] = {k: (v if k % 3 else s) for k in range(1, 13)}  # one layout per id
    live, gone = list(range(1, 13)), [99]  # 99: never made

    def pick() -> int:  # mostly a recent live id, sometimes a freed or unknown one
        return rng.choice(gone) if rng.random() < 0.05 or not live else rng.choice(live[-6:])

    def target(like: torch.Tensor) -> int:  # mostly a new storage, sometimes a live or freed one
        if rng.random() < 0.1:
            return pick()
        out = max(shapes) + 1
        shapes[out] = like
        live.append(out)
        return out

    stream: list[list[bytes]] = []
    for _ in range(150):
        batch = []
        for _ in range(rng.randint(1, 8)):
            a = pick()
            like = shapes.get(a, v)
            b = rng.choice([k for k in live[-6:] if shapes[k] is like] or [a])
            kind = rng.random()
            if kind < 0.35:
                out = target(like)
                batch.append(op("aten::add.Tensor", [T(a, like), T(b, like)], {}, [T(out, shapes.get(out, like))]))
            elif kind < 0.45:
                batch.append(op("aten::mul_.Tensor", [T(a, like), 0.5], {}, [T(a, like)]))
            elif kind < 0.6:
                out = target(like)
                batch.append(op("aten::add.out", [T(a, like), 1], {"out": T(out, like)}, [T(out, like)]))
            elif kind < 0.75:  # floor division by values that reach 0: some kernels raise, their outputs poisoned
                out = target(like)
                batch.append(op("aten::div.Tensor_mode", [T(a, like), T(b, like)], {"rounding_mode": "floor"},
                                [T(out, like)]))
            elif kind < 0.85 and len(live) > 8:
                dead = rng.sample(live[:-4], 2)
                for k in dead:
                    live.remove(k)
                gone.extend(dead)
                batch.append(free(*dead))
            else:
                scalar = rng.choice([k for k in live if shapes[k] is s] or [a])
                batch.append(call(rng.randint(1000, 9999), "aten::_local_scalar_dense.default", [T(scalar, s)]))
        stream.append(batch)
    uploads = [(k, 0, torch.arange(float(t.numel()), dtype=torch.int64).to(t.dtype).reshape(t.shape) + k)
               for k, t in shapes.items() if k <= 12]
    def play(native: bool) -> tuple[list[str], list[Any], int]:
        if not native:
            monkeypatch.setattr(plans, "Runner", None)
        srv = inproc_server(devices=1, isolation="none")
        c = raw_clients(srv.port)
        c.send_batch([], uploads=uploads)
        answers = []
        for batch in stream:  # every reply: each CALL's (its number or error, deferred errors), then the sync's
            c.send_batch([*batch, sync(c.next_req())])
            for _ in range(sum(cmd[:2] == plans.CALL_PREFIX for cmd in batch) + 1):
                r = c.reply()
                answers.append(repr((r.req, r.error, r.result, r.deferred)))  # repr: nan equals nan
        values = []
        for k, like in shapes.items():
            r = c.request([raw_fetch(c.next_req(), desc(k, like))])
            values.append((r.error, r.payload))
        return answers, values, _native(srv)

    with_native, without = play(True), play(False)
    assert with_native[0] == without[0] and with_native[1] == without[1]
    assert with_native[2] > 40 and without[2] == 0  # the stream did run natively where it could


def test_calls_answer_numbers_of_every_kind_and_carry_the_errors_waiting(server, connect) -> None:
    """A CALL by plan answers floats, ints of every size and sign, bools and infinities as the full path does
    (the native runner writes those replies itself); an error deferred earlier in the batch rides along."""
    values = [torch.tensor(2.5), torch.tensor(float("-inf")), torch.tensor(-(1 << 40)), torch.tensor(7),
              torch.tensor(200, dtype=torch.uint8), torch.tensor(-3, dtype=torch.int8), torch.tensor(True),
              torch.tensor(1 << 62), torch.tensor(-20, dtype=torch.int16)]
    srv = server()
    c = connect(srv)
    c.send_batch([], uploads=[(k + 1, 0, v) for k, v in enumerate(values)])
    for _ in range(3):
        for k, v in enumerate(values):
            r = c.request([call(c.next_req(), "aten::_local_scalar_dense.default", [T(k + 1, v)])])
            assert r.error is None and r.deferred == [] and r.result == v.item() and type(r.result) is type(v.item())
    assert _planned(srv) >= 2 * len(values)  # all but the first of each dtype's signature
    assert _native(srv) == (_planned(srv) if _native_mode() else 0)
    c.send_batch([free(50)], uploads=[(50, 0, F)])
    r = c.request([_add(50, 51), call(c.next_req(), "aten::_local_scalar_dense.default", [T(1, values[0])])])
    assert r.result == 2.5 and len(r.deferred) == 1 and "freed" in r.deferred[0]["message"]


def test_an_out_op_into_live_storages_runs_by_its_plan_with_the_out_argument_as_a_slot(server, connect) -> None:
    """``torch.mul(a, b, out=c)`` into a storage the session holds (what optimizers' in-place steps send): the
    out argument is a tensor slot among the keyword arguments, and later commands run by plan (natively where
    the runner is built), writing each out storage in place."""
    srv = server()
    c = connect(srv)
    n = 6
    cmds = [op("aten::mul.out", [T(1, F), T(2, F)], {"out": T(10 + k, F)}, [T(10 + k, F)]) for k in range(n)]
    c.send_batch(cmds, uploads=[(1, 0, torch.tensor([3.0])), (2, 0, torch.tensor([-2.0])),
                                *((10 + k, 0, torch.zeros(1)) for k in range(n))])
    assert c.sync().deferred == []
    assert [c.fetch(10 + k, F).item() for k in range(n)] == [-6.0] * n
    assert _planned(srv) == n - 1 and _native(srv) == (n - 1 if _native_mode() else 0)


@pytest.mark.parametrize("cmd", [b"\x92\x03", b"\x92\x03\x91", b"\x92\x03\x91\xcd\x01", b"\x92\x03\xdc\x00",
                                 b"\x92\x03\x92\x05", b"\x92\x03\x91\x05\x00"])
def test_a_malformed_free_closes_the_session_as_on_the_full_path(server, connect, cmd: bytes) -> None:
    """FREE commands cut short or with trailing bytes (the native runner parses FREEs): the session ends with
    the frame error Python's decode gives, its storages are freed, and the server serves the next session."""
    srv = server()
    c = connect(srv)
    zero = torch.zeros(1)
    c.send_batch([_add(1, 2), _add(2, 3), free(2)], uploads=[(1, 0, zero)])  # a plan and a native FREE first
    assert c.sync().deferred == []
    c.send_batch([cmd])
    kind, body, _ = c.recv()
    assert kind.name == "ERROR" and body["code"] == "frame", body
    other = connect(srv)
    other.send_batch([_add(1, 2)], uploads=[(1, 0, zero)])
    assert other.sync().deferred == [] and other.fetch(2, F).item() == 1.0


def test_a_call_answering_with_a_view_of_its_input_keeps_a_copy_by_plan_too(server, connect) -> None:
    """A CALL whose result is a view of an input: the full path keeps a copy under the output id (one storage
    never gets two ids). By plan the native runner hands such a result back with the storages it used, and
    the copy is made the same way: writing the input afterwards leaves the CALL's output as it was."""
    v = torch.empty(2)
    srv = server()
    c = connect(srv)
    c.send_batch([], uploads=[(1, 0, torch.tensor([1.0, 2.0])), (2, 0, torch.tensor([3.0, 4.0]))])
    for src, out in ((1, 5), (2, 6)):  # the second by plan
        r = c.request([call(c.next_req(), "aten::view", [T(src, v), [2]], outs=[out])])
        assert r.error is None and r.deferred == []
    assert _planned(srv) == 1 and _native(srv) == (1 if _native_mode() else 0)
    c.send_batch([op("aten::mul_.Tensor", [T(2, v), 10], {}, [T(2, v)])])
    assert c.sync().deferred == []
    assert c.fetch(6, v).tolist() == [3.0, 4.0] and c.fetch(2, v).tolist() == [30.0, 40.0]


def test_small_ops_run_on_one_intra_op_thread_and_large_ones_on_the_pool() -> None:
    """Waking the node's sleeping OpenMP pool costs more than a small op's work (a 2-layer transformer step:
    12.6 to 14 ms with the pool, 5.4 to 5.7 ms so): below SERIAL_BELOW elements an op runs on one thread;
    the thread's own count comes back for a large one. Run in a thread of its own: the count is per thread."""
    import threading

    seen: list[int] = []

    def body() -> None:
        before = torch.get_num_threads()
        plans.use_serial(True)
        seen.append(torch.get_num_threads())
        plans.use_serial(False)
        seen.append(torch.get_num_threads() - before)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [1, 0]
    assert plans.serial_size([[16, 64], [8, 128]]) and not plans.serial_size([[1000, 1000]])
    assert plans.serial_size([]) and not plans.serial_size([[plans.SERIAL_BELOW]])
