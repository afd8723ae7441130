"""Issue 28, findings 8 to 10: ops that read or write past their buffers, error texts that echo memory, bounds.

Against a real node with a bystander session: an out form whose kernel writes its own dtype into any out
(``_logcumsumexp.out``: 96 bytes into a 24-byte uint8 buffer) is refused; embedding bags with offsets that
point before or past their indices are refused before the kernel reads the word before its buffer; no error
text carries a number the call did not give; inline tensors keep the bounds of every other tensor; a
session's first op does not pay its worker's warm-up on its deadline.
"""

from __future__ import annotations

import re
import time

import msgpack
import pytest
import torch

from genie.server import validators
from genie.server.ops import WITHHELD, known_numbers, run_op, scrub
from genie.testing import serve_subprocess
from genie.wire.frame import MsgKind
from genie.wire.messages import CMD_OP
from genie.wire.values import EXT_INLINE_TENSOR, inline_tensor
from tests.raw_client import RawClient, T, call, desc, only_error, op, pack, sync
from tests.security import sweep_out_dtypes

_F32 = desc(1, torch.ones(1))[1]
_U8 = desc(1, torch.ones(1, dtype=torch.uint8))[1]
aten = torch.ops.aten


@pytest.fixture(scope="module")
def server():
    """One node process (one CPU device) for this module."""
    with serve_subprocess("--port", "0", "--devices", "cpu") as s:
        yield s





def _numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", text)}


# -- finding 8: out forms that write past their out -------------------------------------------------------


X = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fresh", [False, True], ids=["held-out", "fresh-out"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float64])
def test_logcumsumexp_out_of_another_dtype_is_refused_held_or_fresh(client, fresh, dtype):
    out = T([3, desc(1, torch.ones(1, dtype=dtype))[1], [6, 4], [4, 1], 0, 24 * dtype.itemsize])
    uploads = [(2, 0, X)] + ([] if fresh else [(3, 0, torch.zeros(6, 4, dtype=dtype))])
    error = only_error(client, op("aten::_logcumsumexp.out", [T(2, X), 0], {"out": out}, outs=[None]), uploads)
    assert "refused before running" in error["message"] and "computes torch.float32" in error["message"], error
    assert "pass a torch.float32 out" in error["message"]


def test_logcumsumexp_out_of_its_own_dtype_still_computes_it(client):
    r = client.request([op("aten::_logcumsumexp.out", [T(2, X), 0], {"out": T(3, X)}, outs=[None]),
                        sync(client.next_req())], [(2, 0, X), (3, 0, torch.zeros(6, 4))])
    assert not r.deferred, r
    assert torch.allclose(client.fetch(3, X), torch.logcumsumexp(X, 0))


def test_the_out_dtype_rule_covers_exactly_the_out_forms_no_meta_or_composite_kernel_checks():
    checked = sorted(name for name, overload in sweep_out_dtypes.out_overloads()
                     if validators.out_dtype_check(overload) is not None)
    assert "aten::_logcumsumexp.out" in checked and "aten::masked_select.out" in checked
    assert "aten::add.out" not in checked and "aten::cumsum.out" not in checked  # their meta kernels check
    assert len(checked) < 20, checked  # a native plan is never built for an op with a check


def test_out_forms_exempted_from_the_rule_refuse_a_mismatching_dtype_in_their_own_kernel():
    """KERNEL_CHECKS_OUT_DTYPES holds only kernels that check out dtypes themselves: pinned here."""
    x, w, b = torch.randn(4, 3, 5), torch.ones(3), torch.zeros(3)
    wrong = torch.empty(0, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="expected scalar type Float"):
        aten._batch_norm_with_update.out(x, w, b, torch.zeros(3), torch.ones(3), 0.1, 1e-5, out=wrong,
                                         save_mean=torch.empty(0), save_invstd=torch.empty(0),
                                         reserve=torch.empty(0, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="expected scalar type Float"):
        aten._native_batch_norm_legit.out(x, w, b, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5, out=wrong,
                                          save_mean=torch.empty(0), save_invstd=torch.empty(0))
    a, rhs = torch.randn(4, 3), torch.randn(4, 2)
    outs = [torch.empty(0, dtype=torch.uint8), torch.empty(0), torch.empty(0, dtype=torch.int64), torch.empty(0)]
    with pytest.raises(RuntimeError, match="dtype"):
        aten.linalg_lstsq.out(a, rhs, solution=outs[0], residuals=outs[1], rank=outs[2], singular_values=outs[3])
    assert len(validators.KERNEL_CHECKS_OUT_DTYPES) == 3


def test_out_forms_with_a_mismatching_out_dtype_never_harm_the_worker_or_a_bystander():
    """tests/security/sweep_out_dtypes.py over the out forms the rule covers and a fixed sample of the others
    (``python -m tests.security.sweep_out_dtypes`` runs every one): each call refused or converted right."""
    names = [name for name, overload in sweep_out_dtypes.out_overloads()]
    ruled = [n for n, o in sweep_out_dtypes.out_overloads() if validators.out_dtype_check(o) is not None]
    report = sweep_out_dtypes.run([*ruled, *names[::60]])
    print(report.summary())
    assert report.sampled >= len(ruled) and report.calls > 40, report.summary()
    assert not report.wrong_values and not report.sessions_lost, report
    assert not report.node_deaths and not report.bystander_failures


# -- finding 9: offsets before their buffer, and words read from memory in error texts -------------------


WEIGHT = torch.randn(10, 3, generator=torch.Generator().manual_seed(2))
INDICES = torch.tensor([1, 2, 3, 4])


def _bag(offsets: list[int], indices: torch.Tensor = INDICES, name: str = "aten::_embedding_bag") -> tuple:
    o = torch.tensor(offsets)
    args = [T(2, WEIGHT), T(3, indices), T(4, o), False, 0, False, None, False, -1]
    if name == "aten::embedding_bag":
        args = args[:8]
    return op(name, args, outs=[None] * 4), [(2, 0, WEIGHT), (3, 0, indices), (4, 0, o)]


@pytest.mark.parametrize("offset", [-1, -2, -3, -8, -100, -(2**20)])
def test_embedding_bag_negative_offsets_are_refused_and_echo_no_word(client, offset):
    """Each of 6 negative offsets printed the 8-byte word before the indices' buffer, in decimal."""
    cmd, uploads = _bag([0, offset])
    error = only_error(client, cmd, uploads)
    assert "refused before running" in error["message"] and "offsets must start at 0" in error["message"], error
    assert _numbers(error["message"]) <= {0, 4, 2, 28} | {abs(offset)}, error["message"]


@pytest.mark.parametrize(("offsets", "indices", "expect"), [
    ([0, 3, 1], INDICES, "offsets must not decrease"),
    ([0, 5], INDICES, "lie in [0, 4]"),
    ([0, 2], torch.tensor([1, 2, 10, 0]), "indices holds values outside [0, 10)"),
    ([0, 2], torch.tensor([1, -1, 3, 0]), "indices holds values outside [0, 10)"),
])
def test_embedding_bag_offsets_and_indices_past_their_tensors_are_refused(client, offsets, indices, expect):
    for name in ("aten::_embedding_bag", "aten::embedding_bag"):
        cmd, uploads = _bag(offsets, indices, name)
        assert expect in only_error(client, cmd, uploads)["message"]


def test_well_formed_embedding_bags_still_compute_the_right_result(client):
    offsets = torch.tensor([0, 1, 4])
    args = [T(2, WEIGHT), T(3, INDICES), T(4, offsets), False, 0, False, None, False, -1]
    r = client.request([call(client.next_req(), "aten::_embedding_bag", args, outs=[20, 21, 22, 23])],
                       [(2, 0, WEIGHT), (3, 0, INDICES), (4, 0, offsets)])
    assert r.error is None, r.error
    want = aten._embedding_bag(WEIGHT, INDICES, offsets, False, 0, False, None, False, -1)[0]
    assert torch.allclose(client.fetch(r.result[0]), want)


def test_a_kernel_error_that_read_memory_is_scrubbed_of_every_word_the_call_did_not_give():
    """The finding's own kernel error, validators bypassed: run_op scrubs it against the call's numbers. The
    indices are a view whose storage holds a pointer-like word just before them, which the kernel reads for
    offset -1 and printed, so what it echoes is known here (a word of the heap otherwise)."""
    storage = torch.tensor([140415049499560, 7777, 1, 2, 3, 4])
    with pytest.raises(RuntimeError) as caught:
        run_op(aten._embedding_bag.default, [WEIGHT, storage[2:], torch.tensor([0, -1]), False, 0, False, None,
                                             False, -1], {})
    message = str(caught.value)
    assert "takes value …" in message and "140415049499560" not in message, message
    assert _numbers(message) <= {0, 1, 10}, message


def test_a_kernel_error_keeps_the_numbers_the_call_gave():
    x = torch.zeros(5000)
    with pytest.raises(IndexError) as caught:
        run_op(aten.select.int, [x, 0, 7000], {})
    assert "7000" in str(caught.value) and "5000" in str(caught.value) and WITHHELD not in str(caught.value)


@pytest.mark.parametrize(("text", "known", "want"), [
    ("at 0x7ffd12345678 and 0x55d0aa10", None, "at 0x… and 0x…"),
    ("value 140415049499560 here", None, "value … here"),
    ("value -71165890124513281", set(), "value -…"),
    ("value 49 of 2147483647 elements", None, "value 49 of 2147483647 elements"),  # short, or no context
    ("value 7531 of shape [4096, 3]", {4096, 3}, "value … of shape [4096, 3]"),
    ("word 7f3a9c0012ab, digest " + "ab12" * 16, None, "word …, digest " + "ab12" * 16),
    ("1e-05, 0.000123456, torch.float32, max_pool3d", set(), "1e-05, 0.000123456, torch.float32, max_pool3d"),
])
def test_scrub_withholds_numbers_in_any_base_but_keeps_names_floats_and_given_numbers(text, known, want):
    assert scrub(text, known) == want


def test_known_numbers_are_a_calls_values_sizes_strides_and_small_index_values():
    t = torch.zeros(3, 4096)
    known = known_numbers([t.t(), [2, -5], 7.0, torch.tensor([1234, -9999])], {"dim": 4097})
    assert {4096, 3, 12288, 49152, 2, 5, 7, 1234, 9999, 4097} <= known


# -- finding 10: inline tensors bounded; the first op's deadline -------------------------------------------


def _inline_op(shape: list[int], raw: bytes) -> bytes:
    bad = msgpack.ExtType(EXT_INLINE_TENSOR, msgpack.packb([_F32, shape, raw], use_bin_type=True))
    return pack([CMD_OP, 0, "aten::add.Tensor", [bad, 1], {}, [None]])


@pytest.mark.parametrize("dims", [65, 500_001])
def test_inline_tensors_of_more_than_64_dims_close_only_that_connection(server, client, dims):
    client.send_batch([_inline_op([1] * dims, b"\0\0\0\0"), sync(client.next_req())])
    kind, body, _ = client.recv()
    assert kind == MsgKind.ERROR and "inline tensor" in body["reason"] and "64" in body["reason"], body


def test_an_inline_tensor_of_64_dims_still_runs(client):
    out = [9, _F32, [1] * 64, [1] * 64, 0, 4]
    r = client.request([op("aten::add.Tensor", [inline_tensor(torch.ones([1] * 64)), 1], outs=[T(out)]),
                        sync(client.next_req())])
    assert not r.deferred, r
    assert client.fetch(out).reshape(-1).tolist() == [2.0]


def test_inline_tensors_with_sizes_past_two_to_the_62_are_refused(client):
    client.send_batch([_inline_op([0, 2**62, 2**62], b""), sync(client.next_req())])
    kind, body, _ = client.recv()
    assert kind == MsgKind.ERROR and "more than 2**62 elements" in body["reason"], body


def test_a_sessions_first_op_does_not_pay_its_workers_warm_up_on_its_deadline():
    """A deadline shorter than the pre-flight's first import (1.1 s idle, 1 to 5 s loaded): the first op of a
    fresh worker waits for the warm-up outside its clock and is not killed; a later slow op still is."""
    with serve_subprocess("--port", "0", "--devices", "cpu", env={"GENIE_OP_DEADLINE": "0.4"}) as node:
        sessions = []
        for _ in range(3):  # each takes a worker that started moments before
            c = RawClient(node.port, timeout=30)
            c.handshake()
            sessions.append(c)
        for c in sessions:
            began = time.monotonic()
            r = c.request([op("aten::add.Tensor", [T(2, torch.ones(3)), 1], outs=[T(5, torch.ones(3))]),
                           sync(c.next_req())],
                          [(2, 0, torch.ones(3))])
            assert not r.deferred and r.error is None, r
            assert c.fetch(5, torch.ones(3)).tolist() == [2.0] * 3, time.monotonic() - began
        for c in sessions:
            c.close()
