"""The native op path (genie/csrc/device/fastpath.cpp), against a real server process.

A signature Python handled once is queued by C++ alone afterwards; every test here repeats a call so
that its later rounds take that path, and compares each round with local CPU results: what C++
encodes must be what Python would have sent.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import genie
from genie import _C

D0 = "remote_accelerator:0"
D1 = "remote_accelerator:1"

pytestmark = pytest.mark.usefixtures("remote")


def native_hits() -> int:
    return _C.fast_counts()[0]


def test_a_repeated_signature_is_queued_natively_and_computes_the_same() -> None:
    x = torch.arange(16.0, device=D0)
    expected = torch.arange(16.0) * 2 + 1
    for _ in range(2):  # the first call also tells C++ how the op keys floats; the second teaches
        torch.testing.assert_close((x * 2 + 1).cpu(), expected)
    before = native_hits()
    for _ in range(5):
        torch.testing.assert_close((x * 2 + 1).cpu(), expected)
    assert native_hits() - before >= 10, "mul and add of every later round are answered natively"


def test_new_float_values_under_one_signature_are_each_sent() -> None:
    """Optimizer-style scalars change every step; the signature keys them by type, the command carries them."""
    x, ref = torch.ones(4, device=D0), torch.ones(4)
    g, gref = torch.full((4,), 0.5, device=D0), torch.full((4,), 0.5)
    for v in (0.9, 0.5, 1.5, 2.0, -3.25, 1e-8):
        x.mul_(v).add_(g, alpha=v)
        x.addcdiv_(g, g.add(1.0), value=-v)
        ref.mul_(v).add_(gref, alpha=v)
        ref.addcdiv_(gref, gref.add(1.0), value=-v)
    torch.testing.assert_close(x.cpu(), ref)


def test_views_with_offsets_and_strides_and_out_arguments() -> None:
    base, ref = torch.arange(20.0, device=D0), torch.arange(20.0)
    for _ in range(3):
        base[2:12:2].add_(1)
        ref[2:12:2].add_(1)
        torch.add(base[:5], base[5:10], alpha=2, out=base[10:15])
        torch.add(ref[:5], ref[5:10], alpha=2, out=ref[10:15])
        torch.testing.assert_close(base.cpu(), ref)


def test_ints_bools_dtypes_strings_and_lists_cross_as_python_sends_them() -> None:
    torch.manual_seed(0)
    c = torch.randn(3, 4)
    x = c.to(D0)
    idx_c = torch.tensor([2, 0])
    idx = idx_c.to(D0)
    calls = [
        lambda t, i: t.sum(dim=[1], keepdim=True),
        lambda t, i: t.cumsum(0, dtype=torch.float64),
        lambda t, i: F.gelu(t, approximate="tanh"),
        lambda t, i: t.clamp(min=-0.5, max=0.5),
        lambda t, i: t.masked_fill(t > 0, 1.5),
        lambda t, i: torch.cat([t, t * 2], 1),
        lambda t, i: t.index_select(0, i),
        lambda t, i: t[i],
        lambda t, i: t.transpose(0, 1).contiguous(memory_format=torch.contiguous_format),
        lambda t, i: (t > 0).logical_and(t < 1),
        lambda t, i: t.new_zeros(2) + 3,
        lambda t, i: torch.where(t > 0, t, -1.0),
        lambda t, i: t.argmax(dim=1),
    ]
    for _ in range(3):
        for call in calls:
            got = call(x, idx).cpu()
            torch.testing.assert_close(got, call(c, idx_c))


def test_a_batch_filled_natively_goes_out_whole_and_in_order(python_ops: list[str]) -> None:
    """A full native queue is sent by Python's flush, and the op that found it full is queued natively after
    it: no op takes Python's whole path only to flush (each one did, once per batch, 60 us and more)."""
    y = torch.zeros(1, device=D0)
    for i in range(4):  # taught
        y.add_(1).mul_(1 if i % 2 else 1.0)
    python_ops.clear()
    batches = genie.stats()["batches"]
    for i in range(3000):  # several batches: the native queue reports full, Python sends it
        y.add_(1).mul_(1 if i % 2 else 1.0)
    assert genie.stats()["batches"] - batches >= 6 and python_ops == []
    assert y.item() == 3004


def test_an_empty_out_argument_the_op_resizes_is_answered_natively(python_ops: list[str]) -> None:
    """``torch.arange(n, device=...)`` hands ATen's out= kernel an empty tensor, which the op resizes (a
    decode step of Hugging Face's generate makes three so). Once taught, genie._C gives each such target the
    layout over a new storage id, as Python's set_layout does; a target that has a storage already (its
    resize must reach the node) still goes to Python."""
    a, b = torch.ones(2, 3, device=D0), torch.zeros(1, 3, device=D0)
    for _ in range(2):  # taught
        torch.arange(3, 11, device=D0)
        torch.cat([a, b], out=torch.empty(0, device=D0))
    python_ops.clear()
    ranges = [torch.arange(3, 11, device=D0) for _ in range(3)]
    cats = [torch.cat([a, b], out=torch.empty(0, device=D0)) for _ in range(2)]
    assert python_ops == []
    ids = [_C.storage_id(t) for t in ranges + cats]
    assert len(set(ids)) == 5 and 0 not in ids
    for t in ranges:
        assert torch.equal(t.cpu(), torch.arange(3, 11))
    for t in cats:
        assert torch.equal(t.cpu(), torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    held = torch.arange(4, device=D0)  # 32 bytes
    held.resize_(0)  # the signature of an empty target, over a storage that has an id and bytes
    python_ops.clear()
    torch.arange(3, 11, out=held)
    assert python_ops == ["aten::arange.start_out"]
    assert torch.equal(held.cpu(), torch.arange(3, 11))


def test_threads_queue_ops_on_one_session() -> None:
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            t = torch.zeros(2, device=D0)
            for _ in range(800):
                t.add_(k)
            results[k] = t.sum().item()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert results == {1: 1600.0, 2: 3200.0, 3: 4800.0}


def test_mixed_devices_still_raise_once_the_signature_is_known() -> None:
    a, b = torch.ones(2, device=D0), torch.ones(2, device=D1)
    (a + a).cpu()
    (a + a).cpu()
    with pytest.raises(RuntimeError, match="found at least two devices"):
        a + b
    with pytest.raises(RuntimeError, match="found at least two devices"):
        a + torch.ones(2)  # a CPU tensor with dimensions
    torch.testing.assert_close((b + b).cpu(), torch.full((2,), 2.0))


def test_a_number_wrapped_in_a_cpu_tensor_crosses_as_a_number() -> None:
    x = torch.arange(4, device=D0)
    for k in (1, 2, 7):
        torch.testing.assert_close((x + k).cpu(), torch.arange(4) + k)
        torch.testing.assert_close((x * 0.5).cpu(), torch.arange(4) * 0.5)
        torch.testing.assert_close((x > 1).cpu(), torch.arange(4) > 1)


def test_copies_between_tensors_of_one_device_are_queued_natively() -> None:
    """``clone``, ``dst.copy_(src)`` and a gradient's accumulation copy on the server without Python."""
    src_cpu = torch.arange(12.0).reshape(3, 4)
    src = src_cpu.to(D0) * 1  # computed on the device: no host shadow (copies of a shadowed storage go to Python)
    dst = torch.zeros(4, 3, device=D0)
    before = native_hits()
    for _ in range(3):
        torch.testing.assert_close(src.clone().cpu(), src_cpu)
        dst.t().copy_(src)  # a strided destination
        torch.testing.assert_close(dst.cpu(), src_cpu.t())
        torch.testing.assert_close(src.to(torch.float64).cpu(), src_cpu.double())
    assert native_hits() - before >= 6
    other = torch.ones(2, device=D1)
    torch.testing.assert_close(torch.zeros(2, device=D0).copy_(other).cpu(), torch.ones(2))  # across devices


def test_a_free_taken_at_a_flush_goes_after_every_op_queued_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other threads queue natively without the session's lock, so between two steps of one thread's flush
    another may queue an op and drop its input. The flush takes the frees first, then the native queue:
    the op goes out before its input's FREE. (Taken the other way round, the full OpInfo sweep met
    'storage N was freed earlier in this session'.) The other thread's steps run here inside the flush,
    where the race would put them. (genie._C's lane takes them in the same order: lane.cpp.)"""
    from genie.device import registry

    x = torch.ones(4, device=D0)
    for _ in range(3):  # teach mul and sum
        (x * 2).sum().item()
    y = x * 2
    y.sum().item()  # y's storage now exists on the server
    late: list[torch.Tensor] = []
    real = _C.queue_frees

    def another_thread_then_take(qid: int) -> list[int]:
        if not late:
            nonlocal y
            late.append(y.sum())  # queued natively, reads y's storage...
            del y  # ...which is freed now
        return real(qid)

    monkeypatch.setattr(_C, "queue_frees", another_thread_then_take)
    before = native_hits()
    z = (x + 1).sum()
    registry.table().devices[0].connection.sync()  # Python's flush, with the frees it takes
    assert native_hits() > before and late
    monkeypatch.setattr(_C, "queue_frees", real)
    assert z.item() == 8.0
    assert late[0].item() == 8.0


def test_a_descriptor_longer_than_255_bytes_crosses_natively_as_output_and_input() -> None:
    """Thirty dimensions with 9-byte strides make a tensor descriptor of more than 255 bytes: msgpack's
    ext 16 form, for the in-place output of a native command as for its input."""
    x = torch.zeros(1, device=D0).as_strided([1] * 30, [2**40] * 30)
    before = native_hits()
    for _ in range(4):
        x.add_(1)
    assert native_hits() - before >= 2
    assert x.sum().item() == 4.0



def _conv_grads(x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    k = k.detach().requires_grad_()
    return torch.autograd.grad(F.conv2d(x, k, padding=1).square().sum(), [x, k])


_WHOLE_CASES = {  # (the op sent whole, the call on a device)
    "layer_norm": ("aten::native_layer_norm",
                   lambda x, k, w, b: (F.layer_norm(x.permute(0, 2, 3, 1), [8], w, b),)),
    "group_norm": ("aten::native_group_norm", lambda x, k, w, b: (F.group_norm(x, 2, w, b),)),
    "conv2d": ("aten::convolution", lambda x, k, w, b: (F.conv2d(x, k, b, padding=1),)),
    "conv2d_backward": ("aten::convolution_backward", lambda x, k, w, b: _conv_grads(x, k)),
    "addr": ("aten::addr", lambda x, k, w, b: (torch.addr(x[0, 0], w[:6], b[:6]),)),
}


@pytest.mark.parametrize("case", sorted(_WHOLE_CASES))
def test_ops_sent_whole_over_their_composite_kernels_take_the_native_path_too(case: str,
                                                                            python_ops: list[str]) -> None:
    """``registration.WHOLE_OPS`` (convolution, the norms, addr) have a PrivateUse1 kernel of their own over torch's
    composite one; it is genie's fallback, so a repeated signature is queued by C++, not sent by Python, as every
    other op's is (a GPT-2 decode step sent its 25 layer norms a token through Python before)."""
    torch.manual_seed(0)
    name, call = _WHOLE_CASES[case]
    host = (torch.randn(2, 8, 6, 6), torch.randn(8, 8, 3, 3), torch.randn(8), torch.randn(8))
    expected = call(*host)
    remote = [t.to(D0) for t in host]
    _C.fast_forget()  # an earlier test of this process may have taught the same signature
    for round_ in range(4):
        python_ops.clear()
        for got, want in zip(call(*remote), expected, strict=True):
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        if round_ == 0:
            assert name in python_ops, f"Python sends {name}'s first call: {python_ops}"
    assert name not in python_ops, f"{name} still goes through Python: {python_ops}"
