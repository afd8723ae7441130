"""Host shadows (genie.device.shadows) against a real server: reads of uploads answered here, never stale.

Each test counts round trips (``genie.stats()``) to see whether a read was answered from a shadow, and
compares every value with plain CPU torch: a shadow that missed a write would answer the old value.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import genie
from genie import _C
from genie.device import shadows

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


@pytest.fixture(autouse=True)
def _default_bounds() -> Iterator[None]:
    shadows.configure(max_tensor_bytes=shadows.DEFAULT_MAX_TENSOR_BYTES, budget_bytes=shadows.DEFAULT_BUDGET_BYTES)
    yield
    shadows.configure(max_tensor_bytes=shadows.DEFAULT_MAX_TENSOR_BYTES, budget_bytes=shadows.DEFAULT_BUDGET_BYTES)


def trips(read: Callable[[], Any]) -> tuple[Any, int]:
    """``read()`` and the round trips it took."""
    before = genie.stats()["round_trips"]
    value = read()
    return value, genie.stats()["round_trips"] - before


def test_an_uploaded_tensor_is_read_back_without_a_round_trip() -> None:
    host = torch.tensor([[5, 0, 7], [1, 2, 0]])
    ids = host.to(D0)
    host.add_(100)  # the upload is a copy: changing the CPU tensor afterwards changes nothing remote
    got, n = trips(lambda: (ids.tolist(), ids[0, 2].item(), ids.cpu(), bool(ids[1, 1]), str(ids)))
    assert n == 0
    assert got[0] == [[5, 0, 7], [1, 2, 0]] and got[1] == 7 and bool(got[3]) is True
    assert torch.equal(got[2], torch.tensor([[5, 0, 7], [1, 2, 0]])) and "7" in got[4]
    scalar = torch.tensor(3.25, device=D0)  # torch.tensor(value, device=...): a 0-dim upload
    value, n = trips(lambda: float(scalar))
    assert (value, n) == (3.25, 0)


def test_library_checks_on_inputs_are_answered_from_derived_shadows() -> None:
    """What Hugging Face asks of the inputs before a forward or a generate: all answered here."""
    ids_cpu = torch.tensor([[5, 9, 7, 3], [1, 2, 0, 0]])
    ids = ids_cpu.to(D0)
    pad, eos = torch.tensor(0, device=D0), torch.tensor([7], device=D0)

    def checks() -> list[Any]:
        mask = torch.ones(ids.shape, dtype=torch.long, device=D0)
        return [0 in ids[:, [-1, 0]], bool((mask == 1).all()), bool(torch.isin(eos, pad).any()),
                bool((eos < 0).any()), bool(torch.isin(ids, pad).any()), ids.ne(0).long().sum().item(),
                (torch.ones_like(ids[0]).cumsum(0) - 1)[-1].item(), torch.equal(ids, ids.clone())]

    got, n = trips(checks)
    assert n == 0
    assert got == [True, True, False, False, True, 6, 3, True]
    got, n = trips(checks)  # the same signatures again: genie._C's native path steps aside for shadowed storages
    assert n == 0 and got == [True, True, False, False, True, 6, 3, True]


def test_floating_point_results_are_never_derived() -> None:
    x_cpu = torch.tensor([0.1, 0.2, 0.3, 1e-8])
    x = x_cpu.to(D0)
    total, n = trips(lambda: (x * 3).sum().item())
    assert n == 1 and total == (x_cpu * 3).sum().item()
    below, n = trips(lambda: bool((x < 0.25).all()))  # a comparison of floats is exact: derived
    assert (below, n) == (False, 0)


def test_in_place_writes_keep_the_shadow_true_or_drop_it() -> None:
    ids = torch.tensor([1, 2, 3]).to(D0)
    ids.add_(10)  # integer arithmetic on a shadow: applied to the shadow too
    got, n = trips(ids.tolist)
    assert (got, n) == ([11, 12, 13], 0)
    x = torch.tensor([1.0, 2.0, 3.0]).to(D0)
    x.mul_(1.1)  # float arithmetic: the shadow is dropped, the server answers
    got, n = trips(x.cpu)
    assert n == 1 and torch.equal(got, torch.tensor([1.0, 2.0, 3.0]) * 1.1)


def test_writes_through_views_reach_the_shadow_of_their_storage() -> None:
    base = torch.arange(8).to(D0)
    view = base[2:6]
    view.fill_(-1)
    view[1:3].mul_(torch.tensor([2, 3]).to(D0))
    expected = torch.arange(8)
    expected[2:6].fill_(-1)
    expected[3:5].mul_(torch.tensor([2, 3]))
    got, n = trips(base.tolist)
    assert (got, n) == (expected.tolist(), 0)
    f = torch.zeros(6).to(D0)
    f[1:4].add_(torch.tensor([0.5, 1.5, 2.5]).to(D0) / 3)  # a float write through a view drops the whole storage
    got, n = trips(f.cpu)
    assert n == 1 and torch.equal(got, torch.cat([torch.zeros(1), torch.tensor([0.5, 1.5, 2.5]) / 3, torch.zeros(2)]))


def test_out_arguments_drop_the_shadow_of_their_target() -> None:
    target = torch.zeros(4).to(D0)
    a, b = torch.rand(4), torch.rand(4)
    torch.mul(a.to(D0), b.to(D0), out=target)
    got, n = trips(target.cpu)
    assert n == 1 and torch.equal(got, a * b)
    ints = torch.zeros(4, dtype=torch.long).to(D0)
    torch.add(torch.tensor([1, 2, 3, 4]).to(D0), 5, out=ints)  # integer out=: derived into the target's shadow
    got, n = trips(ints.tolist)
    assert (got, n) == ([6, 7, 8, 9], 0)


def test_autograd_gradient_accumulation_and_a_manual_update_drop_shadows() -> None:
    w = torch.tensor([1.0, -2.0, 3.0]).to(D0)  # uploaded without grad: shadowed
    w.requires_grad_()
    w.grad = torch.tensor([0.5, 0.5, 0.5]).to(D0)  # a shadowed .grad: backward accumulates into it in place
    (w * w).sum().backward()
    expected_grad = torch.tensor([0.5, 0.5, 0.5]) + 2 * torch.tensor([1.0, -2.0, 3.0])
    got, n = trips(w.grad.cpu)
    assert n == 1 and torch.equal(got, expected_grad)
    with torch.no_grad():
        w -= 0.25 * w.grad
    got, n = trips(w.detach().cpu)
    assert n == 1 and torch.equal(got, torch.tensor([1.0, -2.0, 3.0]) - 0.25 * expected_grad)


def test_resize_and_set_never_read_a_shadow_of_another_storage_or_size() -> None:
    x = torch.tensor([1, 2, 3, 4]).to(D0)
    x.resize_(64)  # the storage grows: its shadow is of the old size and is not used again
    got, n = trips(lambda: x[:4].tolist())
    assert n == 1 and got == [1, 2, 3, 4]
    y = torch.tensor([7.0, 8.0]).to(D0)
    z = torch.tensor([1.5, 2.5]).to(D0)
    y.set_(z)  # type: ignore[call-overload]  # y now reads z's storage (and its shadow)
    got, n = trips(y.tolist)
    assert (got, n) == ([1.5, 2.5], 0)
    z.mul_(0.3)  # a float write to z's storage: dropped for y too
    got, n = trips(y.cpu)
    assert n == 1 and torch.equal(got, torch.tensor([1.5, 2.5]) * 0.3)


def test_a_freed_storage_loses_its_shadow_and_a_new_tensor_never_reads_it() -> None:
    x = torch.tensor([4, 5, 6]).to(D0)
    sid = _C.storage_id(x)
    assert sid in shadows.TABLE.entries
    del x
    gc.collect()
    torch.ones(1, device=D0).mul(2).cpu()  # a batch goes out: the free with it
    shadows.TABLE.reap()
    assert sid not in shadows.TABLE.entries
    y = torch.empty(3, dtype=torch.long, device=D0)  # a new storage, perhaps at x's Python id: never x's bytes
    assert _C.storage_id(y) != sid
    y.copy_(torch.tensor([1, 1, 1]).to(D0).mul(3))
    got, n = trips(y.tolist)
    assert (got, n) == ([3, 3, 3], 0)


def test_a_compiled_graph_replay_that_writes_its_input_drops_the_shadow() -> None:
    from genie.compile import replay

    def bump(t: torch.Tensor) -> torch.Tensor:
        t.mul_(1.5)
        return t.sum()

    compiled = torch.compile(bump, backend="genie")
    x = torch.tensor([1.0, 2.0, 4.0]).to(D0)
    ref = torch.tensor([1.0, 2.0, 4.0])
    before = replay.counts["replayed"]
    for _ in range(3):
        compiled(x)
        ref.mul_(1.5)
        x.copy_(x.detach())  # no-op on values, keeps the storage
        got, n = trips(x.cpu)
        assert n == 1 and torch.equal(got, ref)
        x = ref.to(D0)  # shadowed again for the next round
        ref = ref.clone()
    assert replay.counts["replayed"] > before, "the writes above came from graph replays"


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
                                  lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True)],
                         ids=["sgd", "adamw-foreach", "adam-fused"])
def test_an_optimizer_step_on_the_server_drops_the_parameters_shadow(make: Callable[[Any], Any]) -> None:
    p = torch.tensor([1.0, -2.0, 3.0]).to(D0)  # uploaded, then made a parameter: shadowed
    p.requires_grad_()
    ref = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    opt, ref_opt = make([p]), make([ref])
    for _ in range(3):
        for param, o in ((p, opt), (ref, ref_opt)):
            o.zero_grad()
            (param * param).sum().backward()
            o.step()
        got, n = trips(p.detach().cpu)
        assert n == 1 and torch.equal(got, ref.detach())


def test_the_native_path_steps_aside_for_a_storage_that_gained_a_shadow() -> None:
    y = (torch.rand(5, device=D0) * 0).long()  # from a random op: no shadow
    assert _C.storage_id(y) not in shadows.TABLE.entries
    hits = _C.fast_counts()[0]
    for _ in range(4):
        y.add_(2)  # taught to genie._C, then queued natively
    assert _C.fast_counts()[0] > hits
    y.copy_(torch.tensor([10, 20, 30, 40, 50]))  # an upload over the whole storage: y is shadowed now
    for _ in range(3):
        y.add_(2)  # the same signature: it must reach Python, which applies it to the shadow
    got, n = trips(y.tolist)
    assert (got, n) == ([16, 26, 36, 46, 56], 0)


def test_calls_python_cannot_derive_stay_native_and_writes_to_a_shadow_never_do(python_ops: list[str]) -> None:
    """genie._C sends Python a call that touches a shadow only when Python has work to do on it: the call writes a
    shadowed storage, or every tensor it reads is shadowed and its dtypes allow deriving (integer arithmetic on
    floats is not derived). A float op on a small uploaded tensor went to Python every call (60 to 80 us)."""
    x_cpu = torch.tensor([0.5, 1.5, -2.0])
    x = x_cpu.to(D0)  # a small float upload: shadowed
    ids_cpu, other_cpu = torch.tensor([1, 2, 3]), torch.tensor([0, 2, 10])
    ids = ids_cpu.to(D0)
    other = torch.arange(3, device=D0) * torch.tensor([7, 2, 5]).to(D0)  # arange is never derived: no shadow
    assert _C.storage_id(x) in shadows.TABLE.entries and _C.storage_id(other) not in shadows.TABLE.entries

    def calls() -> list[torch.Tensor]:
        return [x * 2.0, x + x, ids + other, torch.isin(other, ids), ids * ids, ids.eq(ids)]

    calls()
    calls()  # taught to genie._C by now
    python_ops.clear()
    got = calls()
    # float arithmetic and calls with an unshadowed input: native; integer arithmetic and a comparison of
    # shadows: derived by Python, so their results read back without a round trip
    assert python_ops == ["aten::mul.out", "aten::eq.Tensor_out"]
    (square, same), n = trips(lambda: (got[4].tolist(), got[5].tolist()))
    assert (square, same, n) == ([1, 4, 9], [True, True, True], 0)
    expected = [x_cpu * 2.0, x_cpu + x_cpu, ids_cpu + other_cpu, torch.isin(other_cpu, ids_cpu)]
    for remote_value, value in zip(got[:4], expected, strict=False):
        assert torch.equal(remote_value.cpu(), value)
    got_x, n = trips(x.cpu)
    assert n == 0 and torch.equal(got_x, x_cpu)

    other.add_(ids)  # writes an unshadowed storage, reads a shadow it cannot be derived from: native
    other.add_(ids)
    python_ops.clear()
    other.add_(ids)
    ids.add_(other)  # writes a shadowed storage: Python, which drops the shadow (other's values are remote)
    ids.add_(other)  # no shadow left to keep true: native
    assert python_ops == ["aten::add.out"]
    got_ids, n = trips(ids.tolist)
    assert n == 1 and got_ids == (ids_cpu + 2 * (other_cpu + 3 * ids_cpu)).tolist()


def test_batch_norm_running_statistics_drop_their_shadows_on_both_paths() -> None:
    """native_batch_norm writes running_mean/var although its schema does not mark them (UNMARKED_WRITES)."""
    torch.manual_seed(0)
    local, remote = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    remote.to(D0).train()
    x = torch.randn(8, 3)
    xd = x.to(D0)
    mean, var = remote.running_mean, remote.running_var
    local_mean, local_var = local.running_mean, local.running_var
    assert mean is not None and var is not None and local_mean is not None and local_var is not None
    for step in range(4):  # the first call by Python, the later ones by genie._C's native path
        with torch.no_grad():  # a re-upload over the whole storage: the buffers are shadowed again
            mean.copy_(local_mean)
            var.copy_(local_var)
        assert _C.storage_id(mean) in shadows.TABLE.entries
        remote(xd)
        local(x)
        torch.testing.assert_close(mean.cpu(), local_mean, msg=f"step {step}")
        torch.testing.assert_close(var.cpu(), local_var, msg=f"step {step}")


def test_a_shadow_only_ever_written_is_dropped_and_its_writes_go_native(python_ops: list[str]) -> None:
    """A batch norm's ``num_batches_tracked``: ``add_(1)`` every training step, never read here. Each derived
    write took Python's path (60 to 100 us, against 4 us native: 52 a step of a ResNet-50); after
    ``idle_writes`` of them in a row with no use its shadow goes, and the next writes are native. A shadow read
    between writes, or feeding a derivation of another storage, is kept; values are right throughout."""
    limit = shadows.TABLE.idle_writes
    assert limit == shadows.DEFAULT_IDLE_WRITES == 16
    model = torch.nn.BatchNorm1d(2).to(D0).train()
    tracked = model.num_batches_tracked
    assert tracked is not None and _C.storage_id(tracked) in shadows.TABLE.entries  # a small int upload
    read_every_step = torch.tensor(0).to(D0)
    feeds = torch.tensor([1, 2]).to(D0)
    x = torch.randn(4, 2).to(D0)
    fed: list[torch.Tensor] = []
    for step in range(limit + 3):
        assert (_C.storage_id(tracked) in shadows.TABLE.entries) == (step < limit), step
        model(x)
        read_every_step.add_(1)
        feeds.add_(1)
        fed.append(feeds * 2)  # feeds a derivation of another storage: a use
        value, n = trips(read_every_step.item)
        assert (value, n) == (step + 1, 0)
    sids = {_C.storage_id(t) for t in (tracked, read_every_step, feeds)}
    assert _C.storage_id(tracked) not in shadows.TABLE.entries
    assert sids - {_C.storage_id(tracked)} <= set(shadows.TABLE.entries)
    python_ops.clear()
    for _ in range(3):
        model(x)
    assert python_ops == []  # num_batches_tracked.add_(1) and the batch norm itself: native
    value, n = trips(tracked.item)
    assert (value, n) == (limit + 6, 1)  # a round trip now, and the right value
    got, n = trips(lambda: fed[-1].tolist())
    assert (got, n) == ([2 * (limit + 4), 2 * (limit + 5)], 0)


def test_large_tensors_and_parameters_have_no_shadow_and_the_budget_evicts() -> None:
    big = torch.arange(20000).to(D0)  # 160 KB > 64 KiB
    got, n = trips(lambda: big[-1].item())
    assert (got, n) == (19999, 1)
    layer = torch.nn.Linear(2, 2).to(D0)
    got, n = trips(layer.bias.detach().cpu)
    assert n == 1
    shadows.configure(budget_bytes=256)
    first = torch.arange(16).to(D0)  # 128 bytes
    second = torch.arange(16, 32).to(D0)
    third = torch.arange(32, 48).to(D0)  # the least recently used one (first) leaves
    got, n = trips(lambda: (second.tolist(), third.tolist()))
    assert n == 0
    got, n = trips(first.tolist)
    assert (got, n) == (list(range(16)), 1)
    shadows.configure(max_tensor_bytes=0)  # off
    off = torch.tensor([1, 2]).to(D0)
    got, n = trips(off.tolist)
    assert (got, n) == ([1, 2], 1)
