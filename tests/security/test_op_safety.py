"""Issue 11's crash ops, pre-flight limits and error scrubbing, against a real server process.

Each op that crashed, hung or corrupted a server (tried as a hostile client on
the raw wire) now either is refused by the allow-list, or is validated before
its kernel runs; either way the server survives, a bystander session keeps its
data, and the refusal names the op and the reason.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from genie.server.ops import scrub
from genie.testing import serve_subprocess
from tests.raw_client import Dev, T, desc, only_error, op, sync
from tests.raw_client import resize as resize_cmd
from tests.security.fuzz_ops import run as fuzz_run

_F32 = desc(1, torch.ones(1))[1]


@pytest.fixture(scope="module")
def server():
    """One server process (one CPU device, a 64 MiB session quota) for this module."""
    with serve_subprocess("--port", "0", "--devices", "cpu", env={"GENIE_MAX_SESSION_BYTES": str(64 << 20)}) as s:
        yield s





X = torch.ones(2, 3, 4)
ONE = torch.ones(1)
V3 = torch.ones(3)


@pytest.mark.parametrize(("name", "args"), [
    ("aten::_stack", [[], 1]),
    ("aten::_efficientzerotensor", [[4]]),
    ("aten::_foreach_copy_", [[T(2, V3)], [T(2, V3), T(2, V3)], False]),
    ("aten::_transform_bias_rescale_qkv", [T(2, V3), T(2, V3), 0]),
    ("aten::quantize_per_channel", [T(2, V3), T(2, V3), T(2, V3), 0, torch.quint8]),
    ("aten::_sobol_engine_draw", [T(2, V3), 1, T(2, V3), 1, 1, None]),
    ("aten::_sobol_engine_initialize_state_", [T(2, V3), 1]),
])
def test_crash_ops_are_forbidden_naming_the_op_and_how_to_ask(client, name, args):
    error = only_error(client, op(name, args), [(2, 0, V3)])
    assert error["kind"] == "forbidden", error
    assert name in error["message"] and "allow-list" in error["message"] and "open an issue" in error["message"]


def _bn(running: torch.Tensor) -> list:
    return [T(2, X), None, None, T(3, running), T(3, running), False, 0.1, 1e-5]


@pytest.mark.parametrize(("name", "args", "uploads", "expect"), [
    # a 1-element running_mean for 3 channels: the CPU kernel read past it
    ("aten::native_batch_norm", _bn(ONE), [(2, 0, X), (3, 0, ONE)], "per-channel tensor of shape [1] for 3"),
    ("aten::native_batch_norm", [T(2, ONE), None, None, None, None, True, 0.1, 1e-5], [(2, 0, ONE)],
     "batch and a channel dimension"),
    # an FFT over 2**31 elements (a stride-0 view of one float) crashed the process
    ("aten::_fft_r2c", [T([3, _F32, [2**31], [0], 0, 4]), [0], 0, True], [(3, 0, ONE)], "max_op_elements"),
    ("aten::_fft_r2c", [T(3, V3), [2**31], 0, True], [(3, 0, V3)], "shape checks"),
    ("aten::_foreach_add_.List", [[T(3, V3)], [T(3, V3), T(3, V3)]], [(3, 0, V3)], "every list must be as long"),
    ("aten::_fused_sgd_", [[T(3, V3)], [T(3, V3)], []], [(3, 0, V3)], "momentum_buffer_list is empty"),
    ("aten::_fused_adamw_", [[T(3, V3)], [T(4, ONE)], [T(3, V3)], [T(3, V3)], [], [T(4, ONE)]], [(3, 0, V3), (4, 0, ONE)],
     "for a torch.float32 [3] parameter"),
    # offset2bag indexes grad rows unchecked: it read another session's memory
    ("aten::_embedding_bag_per_sample_weights_backward",
     [T(5, torch.ones(2, 3)), T(6, torch.ones(4, 3)), T(7, torch.tensor([0, 1, 2])), T(8, torch.tensor([0])),
      T(9, torch.tensor([0, 0, 10**6])), 0],
     [(5, 0, torch.ones(2, 3)), (6, 0, torch.ones(4, 3)), (7, 0, torch.tensor([0, 1, 2])), (8, 0, torch.tensor([0])),
      (9, 0, torch.tensor([0, 0, 10**6]))], "offset2bag holds values outside [0, 2)"),
    # include_last_offset with one offset (no bag) wrote past the empty output (killed the process)
    ("aten::_embedding_bag_forward_only",
     [T(3, torch.ones(5, 5)), T(7, torch.tensor([0, 1, 2])), T(8, torch.tensor([0])), False, 0, False, None, True, 2],
     [(3, 0, torch.ones(5, 5)), (7, 0, torch.tensor([0, 1, 2])), (8, 0, torch.tensor([0]))],
     "include_last_offset with 1 offset(s) makes no bag"),
    ("aten::embedding_bag",
     [T(3, torch.ones(5, 5)), T(7, torch.tensor([0, 1, 2])), T(8, torch.tensor([0])), False, 2, False, None, True],
     [(3, 0, torch.ones(5, 5)), (7, 0, torch.tensor([0, 1, 2])), (8, 0, torch.tensor([0]))],
     "give at least two offsets"),
    # 1-d indices with no offsets and a weight that is not contiguous (found by the fuzzer): SIGSEGV
    ("aten::embedding_bag.padding_idx",
     [T([3, _F32, [1 << 20, 3], [0, 0], 0, 12]), T(7, torch.tensor([0, 1, 2])), T([7, 10, [0], [1], 0, 24]), False,
      0, False, None, False, None],
     [(3, 0, torch.ones(3)), (7, 0, torch.tensor([0, 1, 2]))], "no offsets make no bag"),
    # combinations builds r tensors and an n**r mask first, in the pre-flight's meta run too: r = 2**31 never ended
    ("aten::combinations", [T(3, V3), 2**31], [(3, 0, V3)], "r may be at most 64"),
    ("aten::combinations", [T(3, V3), 20], [(3, 0, V3)], "builds a grid of 3**20 elements"),
    # (median/nanmedian over an expanded dim and expanded embedding offsets, which the CPU kernels read past
    # their storage, are served as contiguous copies now: tests/security/test_shape_checks.py)
    # cummax's kernel writes values and indices where self has elements: a 1-element values crashed it
    ("aten::_cummax_helper", [T(3, V3), T(4, ONE), T(7, torch.tensor([0])), 0],
     [(3, 0, V3), (4, 0, ONE), (7, 0, torch.tensor([0]))], "must both have the input's shape [3]"),
    ("aten::_cummin_helper", [T(3, V3), T(4, V3), T(7, torch.tensor([0, 1, 2], dtype=torch.int32)), 0],
     [(3, 0, V3), (4, 0, V3), (7, 0, torch.tensor([0, 1, 2], dtype=torch.int32))], "indices torch.int64"),
    # unsafe=True is served as unsafe=False: the kernel checks the indices
    ("aten::_index_put_impl_", [T(3, V3), [T(7, torch.tensor([0, 1, 10**11]))], T(8, V3), True, True],
     [(3, 0, V3), (7, 0, torch.tensor([0, 1, 10**11])), (8, 0, V3)], "out of bounds"),
    # a dtype sent as a raw int reached the kernel as a ScalarType and killed the server (found by the fuzzer)
    ("aten::scalar_tensor", [0], [], "must be a dtype"),
])
def test_validated_ops_refuse_malformed_arguments_before_running(client, name, args, uploads, expect):
    kwargs = {"dtype": 2**31 - 1} if name == "aten::scalar_tensor" else {}
    if name.startswith("aten::_fused"):
        kwargs = {"weight_decay": 0.0, "momentum": 0.9, "lr": 0.1, "dampening": 0.0, "nesterov": False,
                  "maximize": False, "is_first_step": False} if "sgd" in name else {
                  "lr": 0.1, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
                  "maximize": False}
    error = only_error(client, op(name, args, kwargs), uploads)
    assert expect in error["message"], error
    assert name.split(".")[0] in error["message"] or error["op"].startswith(name.split(".")[0])


def test_well_formed_validated_ops_still_compute_the_right_result(client):
    mean, var = torch.tensor([0.5, 1.0, -1.0]), torch.tensor([1.0, 4.0, 0.25])
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    ref = torch.ops.aten.native_batch_norm(x, None, None, mean, var, False, 0.1, 1e-5)
    outs = [desc(20, ref[0]), None, None]
    r = client.request([op("aten::native_batch_norm", [T(2, x), None, None, T(3, mean), T(4, var), False, 0.1, 1e-5],
                           outs=outs), sync(client.next_req())], [(2, 0, x), (3, 0, mean), (4, 0, var)])
    assert not r.deferred, r
    torch.testing.assert_close(client.fetch(20, ref[0]), ref[0])
    params, grads = [torch.ones(3), torch.zeros(2)], [torch.full((3,), 2.0), torch.full((2,), 3.0)]
    r = client.request([op("aten::_foreach_add_.List", [[T(5, params[0]), T(6, params[1])],
                                                        [T(7, grads[0]), T(8, grads[1])]], {"alpha": -0.5}, outs=[None]),
                        sync(client.next_req())], [(5, 0, params[0]), (6, 0, params[1]), (7, 0, grads[0]),
                                                   (8, 0, grads[1])])
    assert not r.deferred, r
    assert torch.equal(client.fetch(5, params[0]), torch.zeros(3))
    assert torch.equal(client.fetch(6, params[1]), torch.full((2,), -1.5))


def test_reduction_over_a_huge_expanded_input_is_refused_at_once(client):
    """``expand(ones(1), [2**40]).sum()`` ran ~20 minutes; the pre-flight refuses it before a kernel starts."""
    huge = T([3, _F32, [2**40], [0], 0, 4])
    error = only_error(client, op("aten::sum", [huge], outs=[desc(4, torch.ones(()))]), [(3, 0, ONE)])
    assert error["kind"] == "forbidden" and "2**40" in error["message"] and "max_op_elements" in error["message"]


def _rss(server) -> int:
    return psutil.Process(server.process.pid).memory_info().rss


def test_an_output_over_the_quota_is_refused_before_allocating(server, client):
    """``ones([2**28])`` (1 GiB) under a 64 MiB quota: refused by the pre-flight, RSS stays under 2x the quota."""
    before = _rss(server)
    big = torch.empty(2**28, device="meta")
    # The client may lie about the output (here: 4 bytes); the server plans on meta tensors itself.
    lie = [5, _F32, [1], [1], 0, 4]
    for outs in ([desc(5, big)], [lie]):
        error = only_error(client, op("aten::ones", [[2**28]], {"dtype": torch.float32, "device": Dev(0)}, outs=outs))
        assert error["kind"] == "quota", error
        if outs == [lie]:
            assert "1073741824 bytes" in error["message"] and "max_session_bytes" in error["message"]
    assert _rss(server) - before < 2 * (64 << 20)


def test_an_in_place_resize_over_the_quota_is_refused_before_allocating(server, client):
    before = _rss(server)
    error = only_error(client, op("aten::resize_", [T(3, V3), [2**28]], outs=[desc(3, V3)]), [(3, 0, V3)])
    assert error["kind"] == "quota" and "aten::resize_" in error["message"], error
    r = client.request([resize_cmd(0, 8, 1 << 30), sync(client.next_req())], [(8, 0, V3)])
    assert r.deferred and r.deferred[0]["kind"] == "quota"
    assert _rss(server) - before < 2 * (64 << 20)


def test_error_messages_are_scrubbed_of_heap_addresses():
    text = "invalid tensor at 0x7f3a2c001230 (storage 0x55d0c0ffee00), index 0x10 of 0xdeadbeef"
    assert scrub(text) == "invalid tensor at 0x… (storage 0x…), index 0x10 of 0x…"


def test_an_error_message_that_prints_a_whole_tensor_is_cut_and_the_session_goes_on(client):
    """torch's meshgrid error prints its 2-d input: for 2**20 rows a 9.4 MB message, a reply the client refused
    (the session was lost; found by the fuzzer). Records carry at most MAX_MESSAGE_CHARS of it."""
    from genie.server.records import MAX_MESSAGE_CHARS

    tall = T([3, _F32, [1 << 20, 3], [0, 0], 0, 12])
    error = only_error(client, op("aten::meshgrid", [[tall]], outs=[None]), [(3, 0, V3)])
    assert error["message"].startswith("torch.meshgrid: Expected 0D or 1D tensor"), error["message"][:200]
    assert "more characters)" in error["message"] and len(error["message"]) < MAX_MESSAGE_CHARS + 100
    assert client.sync().error is None  # the session goes on


def test_fuzzer_short_seeded_run_keeps_the_server_and_a_bystander_alive():
    """The CI run of tests/security/fuzz_ops.py: every allowed op, seeded, bounded (``nox -s fuzz_ops``: long)."""
    report = fuzz_run(seed=20261123, seconds=40, max_calls=1500)
    print(report.summary())
    assert not report.deaths, report.deaths
    assert not report.bystander_failures, report.bystander_failures
    assert not report.leaks, report.leaks
    assert len(report.ops) > 300 and report.bystander_checks > 10


@pytest.mark.parametrize(("name", "args", "kwargs", "expect"), [
    # found by the fuzzer: a sparse layout made the pre-flight fail inside the session (closing it)
    ("aten::empty.memory_format", [[2, 3]], {"layout": torch.sparse_coo, "device": Dev(0)}, "layout"),
    # found by the fuzzer: pin_memory=True skipped the plan and allocated 16 GiB outside the quota
    ("aten::arange", [2**31], {"pin_memory": True, "device": Dev(0)}, "pin_memory=True"),
])
def test_factory_arguments_outside_what_is_served_are_refused(client, name, args, kwargs, expect):
    error = only_error(client, op(name, args, kwargs, outs=[None]))
    assert error["kind"] == "forbidden" and expect in error["message"], error


@pytest.mark.parametrize(("name", "args", "kwargs", "expect"), [
    # found by the fuzzer: with device=None the meta plan ran the factory on the CPU for real (16 GiB)
    ("aten::arange", [2**31], {}, "an output has 2147483648 elements"),
    ("aten::full", [[2**31], -(2**63)], {}, "an output has 2147483648 elements"),
    # found by the fuzzer: 2**31-1 sections made as many views (30 s, and again in the meta plan)
    ("aten::tensor_split.sections", [T(2, V3), 2**31 - 1], {}, "it would return 2147483647 tensors"),
    ("aten::unbind.int", [T([2, _F32, [2**26], [0], 0, 12])], {}, "it would return 67108864 tensors"),
])
def test_factories_without_a_device_and_huge_splits_are_refused_at_once(client, name, args, kwargs, expect):
    error = only_error(client, op(name, args, kwargs, outs=[None]), [(2, 0, V3)])
    assert error["kind"] == "forbidden" and expect in error["message"], error


_IDX = torch.tensor([[[[10**11]]]])
_PLANE = torch.zeros(1, 1, 2, 2)
_G1 = torch.ones(1, 1, 1, 1)


@pytest.mark.parametrize(("name", "args", "kwargs", "uploads", "expect"), [
    # the kernel adds grad at the flat index each element of indices names, unchecked: 10**11 was SIGSEGV,
    # 5 into a 4-element plane a silent write past it (genie/server/index_checks.py)
    ("aten::max_pool2d_with_indices_backward", [T(2, _G1), T(3, _PLANE), [2, 2], [2, 2], [0, 0], [1, 1], False,
                                                T(4, _IDX)], {}, [(2, 0, _G1), (3, 0, _PLANE), (4, 0, _IDX)],
     "indices holds values outside [-1, 4)"),
    ("aten::adaptive_max_pool2d_backward", [T(2, _G1), T(3, _PLANE), T(4, _IDX)], {},
     [(2, 0, _G1), (3, 0, _PLANE), (4, 0, _IDX.clone().fill_(4))], "indices holds values outside [0, 4)"),
    ("aten::adaptive_max_pool2d_backward", [T(2, _G1), T(3, _PLANE), T(4, torch.zeros(2, dtype=torch.int64))], {},
     [(2, 0, _G1), (3, 0, _PLANE), (4, 0, torch.zeros(2, dtype=torch.int64))], "with grad_output's shape"),
    # CTC reads log_probs at each target's class: 10**11 was SIGSEGV, -5 read outside it
    ("aten::_ctc_loss", [T(2, torch.zeros(4, 1, 3)), T(3, torch.full((1, 2), -5)), [4], [2], 0, False], {},
     [(2, 0, torch.zeros(4, 1, 3)), (3, 0, torch.full((1, 2), -5))], "targets holds values outside [0, 3)"),
    # segment lengths walk data unchecked: a length of 10**6 over 2 elements was SIGSEGV
    ("aten::_segment_reduce_backward", [T(2, ONE), T(2, ONE), T(3, torch.ones(2)), "max"],
     {"lengths": T(4, torch.tensor([10**6]))}, [(2, 0, ONE), (3, 0, torch.ones(2)), (4, 0, torch.tensor([10**6]))],
     "lengths holds values outside [0, 3)"),
    # LAPACK's balancing crashed on NaN
    ("aten::linalg_eigvals", [T(2, torch.full((3, 3), float("nan")))], {},
     [(2, 0, torch.full((3, 3), float("nan")))], "NaN or infinity"),
    # a 1-element grad for 100 rows' pairs: the kernel read past it
    ("aten::_pdist_backward", [T(2, ONE), T(3, torch.zeros(100, 3)), 2.0, T(2, ONE)], {},
     [(2, 0, ONE), (3, 0, torch.zeros(100, 3))], "100 rows make 4950 pairs"),
    ("aten::unfold_backward", [T(2, torch.ones(1, 2)), [100], 0, 2, 1], {}, [(2, 0, torch.ones(1, 2))],
     "unfolding [100] makes [99, 2]"),
    # bincount allocates max + 1 bins: 2**40 asked for 8 TiB
    ("aten::bincount", [T(2, torch.tensor([2**40]))], {}, [(2, 0, torch.tensor([2**40]))], "more than 16777216 bins"),
])
def test_ops_that_index_by_client_data_refuse_indices_outside_their_tensors(client, name, args, kwargs, uploads,
                                                                            expect):
    error = only_error(client, op(name, args, kwargs, outs=[None]), uploads)
    assert expect in error["message"] and name in error["message"], error


def test_validated_pooling_backward_still_matches_the_cpu_kernel(client):
    x = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    out, indices = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    grad = torch.ones_like(out)
    ref = torch.ops.aten.max_pool2d_with_indices_backward(grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices)
    r = client.request([op("aten::max_pool2d_with_indices_backward",
                           [T(2, grad), T(3, x), [2, 2], [2, 2], [0, 0], [1, 1], False, T(4, indices)],
                           outs=[desc(5, ref)]), sync(client.next_req())], [(2, 0, grad), (3, 0, x), (4, 0, indices)])
    assert not r.deferred, r
    assert torch.equal(client.fetch(5, ref), ref)
