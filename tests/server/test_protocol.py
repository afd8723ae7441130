"""The data plane end to end: a real `genie serve` process and a raw wire client."""

from __future__ import annotations

import pytest
import torch

from genie.wire.frame import PROTOCOL_VERSION, MsgKind
from genie.wire.values import dtype_code
from tests.raw_client import Dev, Gen, RawClient, T, call, desc, fetch, free, op, sync
from tests.raw_client import seed as pack_seed


@pytest.fixture
def client(genie_serve):
    with RawClient(genie_serve.port) as c:
        c.handshake()
        yield c


def test_handshake_welcomes_with_node_devices_and_limits(genie_serve):
    with RawClient(genie_serve.port) as c:
        kind, body = c.hello()
    assert kind == MsgKind.WELCOME
    assert body["protocol"] == PROTOCOL_VERSION and body["torch"] == torch.__version__
    assert body["node_id"]
    assert [(d["index"], d["kind"]) for d in body["devices"]] == [(0, "cpu"), (1, "cpu")]
    assert all(d["memory_total"] > 0 and d["name"] for d in body["devices"])
    assert set(body["limits"]) >= {"max_session_handles", "max_session_bytes", "max_frame_bytes"}


def test_wrong_protocol_is_rejected_naming_both_versions(genie_serve):
    with RawClient(genie_serve.port) as c:
        kind, body = c.hello(protocol=99)
    assert kind == MsgKind.REJECT and body["code"] == "protocol"
    assert "99" in body["reason"] and f"speaks {PROTOCOL_VERSION}" in body["reason"]


def test_wrong_torch_version_is_rejected_naming_both_versions(genie_serve):
    with RawClient(genie_serve.port) as c:
        kind, body = c.hello(torch="1.13.1")
    assert kind == MsgKind.REJECT and body["code"] == "torch_version"
    assert "1.13.1" in body["reason"] and torch.__version__ in body["reason"]


def test_same_torch_minor_with_other_patch_is_accepted(genie_serve):
    major, minor = torch.__version__.split(".")[:2]
    with RawClient(genie_serve.port) as c:
        kind, _ = c.hello(torch=f"{major}.{minor}.99")
    assert kind == MsgKind.WELCOME


def test_upload_add_mm_fetch_give_right_numbers(client):
    a, b, w = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 5)
    r = client.request(
        [op("aten::add.Tensor", [T(1, a), T(2, b)], {"alpha": 2}, [desc(10, a + b)]),
         op("aten::mm", [T(10, a), T(3, w)], {}, [desc(11, a @ w)], device=1),
         fetch(client.next_req(), desc(11, a @ w), device=1)],
        uploads=[(1, 0, a), (2, 0, b), (3, 1, w)],
    )
    assert r.error is None and r.deferred == []
    code, shape = r.result
    assert code == dtype_code(torch.float32) and shape == [4, 5]
    got = torch.frombuffer(bytearray(r.payload), dtype=torch.float32).reshape(4, 5)
    torch.testing.assert_close(got, (a + 2 * b) @ w)


def test_fetch_of_a_non_contiguous_view_is_made_contiguous(client):
    x = torch.arange(12.0).reshape(3, 4)
    client.send_batch([], uploads=[(1, 0, x)])
    torch.testing.assert_close(client.fetch(1, x.t()), x.t().contiguous())
    torch.testing.assert_close(client.fetch(1, x[1:, ::2]), x[1:, ::2].contiguous())


def test_views_alias_on_the_server_through_their_shared_storage(client):
    base = torch.zeros(4, 4)
    row = base[1]
    client.send_batch([op("aten::add_.Scalar", [T(1, base), 5.0], {}, [desc(1, base)])], uploads=[(1, 0, base)])
    torch.testing.assert_close(client.fetch(1, row), torch.full((4,), 5.0))
    client.send_batch([op("aten::mul_.Scalar", [T(1, row), 2.0], {}, [desc(1, row)])])
    expected = torch.full((4, 4), 5.0)
    expected[1] = 10.0
    torch.testing.assert_close(client.fetch(1, base), expected)


def test_a_view_op_output_over_the_input_storage_is_accepted(client):
    x = torch.arange(6.0).reshape(2, 3)
    client.send_batch([op("aten::t", [T(1, x)], {}, [desc(1, x.t())]),
                       op("aten::select.int", [T(1, x), 0, 1], {}, [desc(1, x[1])])], uploads=[(1, 0, x)])
    assert client.sync().deferred == []


def test_out_variant_writes_into_the_described_storage(client):
    a = torch.arange(4.0)
    out = torch.zeros(2, 4)
    client.send_batch([op("aten::mul.out", [T(1, a), T(1, a)], {"out": T(2, out[1])}, [desc(2, out[1])])],
                      uploads=[(1, 0, a), (2, 0, out)])
    assert client.fetch(2, out).tolist() == [[0.0] * 4, [0.0, 1.0, 4.0, 9.0]]


def test_fresh_result_with_another_layout_is_copied_into_the_described_one(client):
    x = torch.arange(6.0).reshape(2, 3)
    declared = torch.empty_strided((2, 3), (1, 2))  # column-major
    client.send_batch([op("aten::mul.Scalar", [T(1, x), 2.0], {}, [desc(2, declared)]),
                       call(client.next_req(), "aten::stride.int", [T(2, declared), 0]),
                       call(client.next_req(), "aten::stride.int", [T(2, declared), 1])], uploads=[(1, 0, x)])
    first, second = client.reply(), client.reply()
    assert first.error is None and first.deferred == [] and [first.result, second.result] == [1, 2]
    torch.testing.assert_close(client.fetch(2, declared), x * 2)


def test_fresh_result_into_a_larger_described_storage_is_copied_at_its_offset(client):
    x = torch.arange(3.0)
    big = torch.zeros(10)
    client.send_batch([op("aten::neg", [T(1, x)], {}, [desc(2, big[4:7])])], uploads=[(1, 0, x)])
    assert client.fetch(2, big).tolist() == [0.0] * 4 + [-0.0, -1.0, -2.0] + [0.0] * 3


def test_factory_op_on_a_device_and_dtype(client):
    client.send_batch([op("aten::arange.start_step", [0, 6, 1], {"dtype": torch.int64, "device": Dev(1)},
                          [desc(1, torch.arange(6))], device=1)])
    assert client.fetch(1, torch.arange(6), device=1).tolist() == [0, 1, 2, 3, 4, 5]


def test_unseen_storage_is_made_zeroed_on_first_use(client):
    x = torch.empty(8)
    assert client.fetch(5, x).tolist() == [0.0] * 8
    client.send_batch([op("aten::add_.Scalar", [T(6, x), 1.0], {}, [desc(6, x)])])
    assert client.fetch(6, x).tolist() == [1.0] * 8


def test_empty_op_returns_zeroed_memory(client):
    client.send_batch([op("aten::empty.memory_format", [[1024]], {"dtype": torch.float32},
                          [desc(1, torch.empty(1024))])])
    assert torch.count_nonzero(client.fetch(1, torch.empty(1024))) == 0


def test_empty_storage_zero_is_fine_as_input_and_output(client):
    e = torch.empty(0, 3)
    client.send_batch([op("aten::add.Tensor", [T(0, e), T(0, e)], {}, [desc(0, e)])])
    assert client.sync().deferred == []
    assert client.fetch(0, e).shape == (0, 3)


def test_call_nonzero_returns_metadata_of_a_data_dependent_shape(client):
    x = torch.tensor([0.0, 3.0, 0.0, 1.0, 2.0])
    req = client.next_req()
    r = client.request([call(req, "aten::nonzero", [T(1, x)], {}, [2])], uploads=[(1, 0, x)])
    assert r.req == req and r.error is None
    expected = torch.nonzero(x)
    assert r.result == desc(2, expected)
    assert client.fetch(r.result).flatten().tolist() == [1, 3, 4]


def test_call_returning_a_view_of_an_input_gets_its_own_storage(client):
    x = torch.arange(4.0)
    r = client.request([call(client.next_req(), "aten::alias", [T(1, x)], {}, [2])], uploads=[(1, 0, x)])
    assert r.error is None and r.result[0] == 2
    client.send_batch([op("aten::zero_", [T(1, x)], {}, [desc(1, x)])])
    assert client.fetch(r.result).tolist() == [0.0, 1.0, 2.0, 3.0]  # a copy: zeroing storage 1 left it alone


def test_call_returning_numbers_and_sizes(client):
    x = torch.tensor([[1.5, 2.0]])
    s = x.sum().reshape(())
    r = client.request([call(client.next_req(), "aten::_local_scalar_dense", [T(1, s)])], uploads=[(1, 0, s)])
    assert r.result == 3.5
    r = client.request([call(client.next_req(), "aten::sym_size.int", [T(2, x), 1])], uploads=[(2, 0, x)])
    assert r.result == 2
    r = client.request([call(client.next_req(), "aten::equal", [T(2, x), T(2, x)])])
    assert r.result is True


def test_deferred_error_names_the_op_and_shapes_at_the_next_reply(client):
    a, b = torch.ones(2, 3), torch.ones(4, 5)
    client.send_batch([op("aten::mm", [T(1, a), T(2, b)], {}, [desc(3, torch.empty(2, 5))])],
                      uploads=[(1, 0, a), (2, 0, b)])
    r = client.sync()
    assert r.error is None
    [err] = r.deferred
    assert err["op"] == "aten::mm" and err["kind"] == "execution"
    assert err["shapes"] == [[2, 3], [4, 5]] and err["storages"] == [3]
    # refused by the pre-flight's meta run (genie.server.preflight) before the kernel: its message names the shapes
    assert ("2x3" in err["message"] and "4x5" in err["message"]) or "[2, 3] X [4, 5]" in err["message"]
    assert client.sync().deferred == []  # each reply carries and clears them


def test_poisoned_storage_reports_the_root_cause(client):
    a = torch.ones(2, 3)
    client.send_batch([op("aten::mm", [T(1, a), T(1, a)], {}, [desc(2, torch.empty(2, 2))]),
                       op("aten::relu", [T(2, torch.empty(2, 2))], {}, [desc(3, torch.empty(2, 2))])],
                      uploads=[(1, 0, a)])
    r = client.request([fetch(client.next_req(), desc(3, torch.empty(2, 2)))])
    assert r.result is None and r.payload == b""
    assert "storage 3" in r.error["message"] and "aten::mm" in r.error["message"]
    kinds = [(e["op"], e["kind"]) for e in r.deferred]
    assert kinds == [("aten::mm", "execution"), ("aten::relu", "execution")]
    assert "storage 2" in r.deferred[1]["message"] and "aten::mm" in r.deferred[1]["message"]


def test_freed_storage_is_an_error_naming_it(client):
    x = torch.ones(3)
    client.send_batch([free(1)], uploads=[(1, 0, x)])
    r = client.request([fetch(client.next_req(), desc(1, x))])
    assert r.error["kind"] == "storage" and "storage 1 was freed" in r.error["message"]


def test_free_of_unknown_ids_is_ignored(client):
    client.send_batch([free(777, 778)])
    assert client.sync().error is None


def test_declared_dtype_mismatch_poisons_the_output(client):
    x = torch.ones(3)
    client.send_batch([op("aten::add.Tensor", [T(1, x), T(1, x)], {}, [desc(2, torch.empty(3, dtype=torch.float64))])],
                      uploads=[(1, 0, x)])
    r = client.request([fetch(client.next_req(), desc(2, torch.empty(3, dtype=torch.float64)))])
    [err] = r.deferred
    assert err["kind"] == "mismatch"
    assert err["message"].startswith("server and client disagree on the output of aten::add.Tensor")
    assert "torch.float32" in err["message"] and "torch.float64" in err["message"]
    assert r.error is not None and "disagree" in r.error["message"]


def test_declared_size_mismatch_is_reported(client):
    x = torch.ones(3)
    client.send_batch([op("aten::add.Tensor", [T(1, x), T(1, x)], {}, [desc(2, torch.empty(4))])],
                      uploads=[(1, 0, x)])
    [err] = client.sync().deferred
    assert err["kind"] == "mismatch" and "[3]" in err["message"] and "[4]" in err["message"]


def test_declared_layout_mismatch_on_a_view_is_an_error(client):
    x = torch.zeros(2, 3)
    client.send_batch([op("aten::t", [T(1, x)], {}, [desc(1, torch.empty(3, 2))])], uploads=[(1, 0, x)])
    [err] = client.sync().deferred
    assert err["kind"] == "mismatch" and "view" in err["message"]


def test_in_place_op_result_is_copied_into_another_known_storage(client):
    x, y = torch.arange(3.0), torch.zeros(3)
    client.send_batch([op("aten::neg", [T(1, x)], {}, [desc(2, y)])], uploads=[(1, 0, x), (2, 0, y)])
    assert client.fetch(2, y).tolist() == [-0.0, -1.0, -2.0]


def test_forbidden_op_is_a_deferred_error_and_the_session_goes_on(client):
    client.send_batch([op("aten::from_file", ["/etc/passwd"], {}, [desc(1, torch.empty(1))])])
    r = client.request([sync(client.next_req())], uploads=[(2, 0, torch.ones(2))])
    [err] = r.deferred
    assert err["kind"] == "forbidden" and "reads a file" in err["message"]
    assert client.fetch(2, torch.ones(2)).tolist() == [1.0, 1.0]


def test_goodbye_ends_the_session_cleanly(genie_serve):
    with RawClient(genie_serve.port) as c:
        c.handshake()
        c.goodbye()
        with pytest.raises(Exception, match="closed"):
            c.recv()


def test_upload_overwrites_an_existing_storage_of_the_same_size(client):
    x = torch.arange(4.0)
    client.send_batch([op("aten::mul_.Scalar", [T(1, x), 2.0], {}, [desc(1, x)])], uploads=[(1, 0, x)])
    client.send_batch([], uploads=[(1, 0, torch.full((4,), 9.0))])  # applied after the mul_ of the batch before
    assert client.fetch(1, x).tolist() == [9.0] * 4


def test_upload_of_another_size_into_a_storage_is_an_error_naming_both(client):
    client.send_batch([], uploads=[(1, 0, torch.zeros(4))])
    client.send_batch([], uploads=[(1, 0, torch.zeros(2))])
    [err] = client.sync().deferred
    assert err["kind"] == "storage" and "8 bytes into storage 1, which has 16" in err["message"]


def test_call_with_too_few_storage_ids_is_a_mismatch(client):
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    r = client.request([call(client.next_req(), "aten::nonzero", [T(1, x)], {}, [])], uploads=[(1, 0, x)])
    assert r.error["kind"] == "mismatch" and "storage ids" in r.error["message"]


def test_random_op_with_a_named_generator_reaches_the_session_generator(client):
    x = torch.empty(64)
    client.send_batch([pack_seed(0, 4, 42), op("aten::uniform_", [T(1, x)], {"generator": Gen(4)}, [desc(1, x)])])
    local = torch.empty(64).uniform_(generator=torch.Generator().manual_seed(42))
    torch.testing.assert_close(client.fetch(1, x), local)  # a CPU node draws what local torch draws


def test_full_upload_into_a_poisoned_storage_makes_it_whole_again(client):
    a = torch.ones(2, 3)
    client.send_batch([op("aten::mm", [T(1, a), T(1, a)], {}, [desc(2, torch.empty(2, 2))])], uploads=[(1, 0, a)])
    client.send_batch([], uploads=[(2, 0, torch.full((2, 2), 3.0))])
    r = client.sync()
    assert [e["op"] for e in r.deferred] == ["aten::mm"]
    assert client.fetch(2, torch.empty(2, 2)).tolist() == [[3.0, 3.0], [3.0, 3.0]]


def test_call_with_an_empty_result_describes_storage_zero(client):
    x = torch.zeros(3)
    r = client.request([call(client.next_req(), "aten::nonzero", [T(1, x)], {}, [2])], uploads=[(1, 0, x)])
    assert r.error is None
    storage_id, code, sizes, _, _, nbytes = r.result
    assert (storage_id, code, sizes, nbytes) == (0, dtype_code(torch.int64), [0, 1], 0)


def test_output_descriptors_may_be_tensor_tags(client):
    """The device client sends outs as tensor tags (the layout cache decodes them); the checks are the same."""
    a = torch.randn(4, 3)
    r = client.request(
        [op("aten::mul.Tensor", [T(1, a), T(1, a)], {}, [T(5, a)]),
         op("aten::add.Tensor", [T(5, a), T(1, a)], {}, [T(6, a)]),
         fetch(client.next_req(), desc(6, a))],
        uploads=[(1, 0, a)],
    )
    assert r.error is None and r.deferred == []
    got = torch.frombuffer(bytearray(r.payload), dtype=torch.float32).reshape(4, 3)
    torch.testing.assert_close(got, a * a + a)
    # a tag that leaves its storage is refused like a descriptor list, for that command only
    bad = [7, dtype_code(torch.float32), [4, 3], [3, 1], 0, 8]
    r = client.request([op("aten::mul.Tensor", [T(1, a), T(1, a)], {}, [T(bad)]), sync(client.next_req())])
    assert r.deferred and r.deferred[0]["kind"] == "protocol" and "storage 7" in r.deferred[0]["message"]
