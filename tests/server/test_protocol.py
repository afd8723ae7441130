"""The data plane end to end: a real `genie serve` process and a raw wire client."""

from __future__ import annotations

import pytest
import torch

from genie.wire.frame import PROTOCOL_VERSION, MsgKind
from genie.wire.values import dtype_code
from tests.raw_client import Dev, H, RawClient, call, fetch, free, op, spec, sync


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
    a = torch.randn(4, 3)
    b = torch.randn(4, 3)
    w = torch.randn(3, 5)
    r = client.request(
        [op("aten::add.Tensor", [H(1), H(2)], {"alpha": 2}, [spec(10, a + b)]),
         op("aten::mm", [H(10), H(3)], {}, [spec(11, (a + b) @ w)]),
         fetch(client.next_req(), 11)],
        uploads=[(1, 0, a), (2, 0, b), (3, 1, w)],
    )
    assert r.error is None and r.deferred == []
    code, shape = r.result
    assert code == dtype_code(torch.float32) and shape == [4, 5]
    got = torch.frombuffer(bytearray(r.payload), dtype=torch.float32).reshape(4, 5)
    torch.testing.assert_close(got, (a + 2 * b) @ w)


def test_fetch_of_a_non_contiguous_view_is_made_contiguous(client):
    x = torch.arange(12.0).reshape(3, 4)
    client.send_batch([op("aten::t", [H(1)], {}, [spec(2, x.t())])], uploads=[(1, 0, x)])
    torch.testing.assert_close(client.fetch(2), x.t().contiguous())


def test_views_alias_on_the_server(client):
    base = torch.zeros(4, 4)
    row = base[1]
    client.send_batch(
        [op("aten::select.int", [H(1), 0, 1], {}, [spec(2, row)]),
         op("aten::add_.Scalar", [H(1), 5.0], {}, [spec(3, base)])],
        uploads=[(1, 0, base)],
    )
    torch.testing.assert_close(client.fetch(2), torch.full((4,), 5.0))
    client.send_batch([op("aten::mul_.Scalar", [H(2), 2.0], {}, [spec(4, row)])])
    expected = torch.full((4, 4), 5.0)
    expected[1] = 10.0
    torch.testing.assert_close(client.fetch(1), expected)


def test_factory_op_on_a_device_and_dtype(client):
    client.send_batch([op("aten::arange.start_step", [0, 6, 1], {"dtype": torch.int64, "device": Dev(1)},
                          [spec(1, torch.arange(6))])])
    assert client.fetch(1).tolist() == [0, 1, 2, 3, 4, 5]


def test_empty_returns_zeroed_memory(client):
    client.send_batch([op("aten::empty.memory_format", [[1024]], {"dtype": torch.float32},
                          [spec(1, torch.empty(1024))])])
    assert torch.count_nonzero(client.fetch(1)) == 0


def test_call_nonzero_returns_metadata_of_a_data_dependent_shape(client):
    x = torch.tensor([0.0, 3.0, 0.0, 1.0, 2.0])
    req = client.next_req()
    r = client.request([call(req, "aten::nonzero", [H(1)], {}, [2])], uploads=[(1, 0, x)])
    assert r.req == req and r.error is None
    assert r.result == spec(2, torch.nonzero(x))
    assert client.fetch(2).flatten().tolist() == [1, 3, 4]


def test_call_returning_numbers_and_sizes(client):
    x = torch.tensor([[1.5, 2.0]])
    r = client.request([call(client.next_req(), "aten::_local_scalar_dense", [H(1)])],
                       uploads=[(1, 0, x.sum().reshape(()))])
    assert r.result == 3.5
    r = client.request([call(client.next_req(), "aten::sym_size.int", [H(2), 1])], uploads=[(2, 0, x)])
    assert r.result == 2
    r = client.request([call(client.next_req(), "aten::equal", [H(2), H(2)])])
    assert r.result is True


def test_deferred_error_names_the_op_and_shapes_at_the_next_reply(client):
    a, b = torch.ones(2, 3), torch.ones(4, 5)
    client.send_batch([op("aten::mm", [H(1), H(2)], {}, [spec(3, torch.empty(2, 5))])],
                      uploads=[(1, 0, a), (2, 0, b)])
    r = client.sync()
    assert r.error is None
    [err] = r.deferred
    assert err["op"] == "aten::mm" and err["kind"] == "execution"
    assert err["shapes"] == [[2, 3], [4, 5]] and err["handles"] == [3]
    assert "2x3" in err["message"] and "4x5" in err["message"]
    assert client.sync().deferred == []  # each reply carries and clears them


def test_poisoned_handle_reports_the_root_cause(client):
    client.send_batch([op("aten::mm", [H(1), H(1)], {}, [spec(2, torch.empty(2, 2))]),
                       op("aten::relu", [H(2)], {}, [spec(3, torch.empty(2, 2))])],
                      uploads=[(1, 0, torch.ones(2, 3))])
    req = client.next_req()
    r = client.request([fetch(req, 3)])
    assert r.result is None and r.payload == b""
    assert "handle 3" in r.error["message"] and "aten::mm" in r.error["message"]
    kinds = [(e["op"], e["kind"]) for e in r.deferred]
    assert kinds == [("aten::mm", "execution"), ("aten::relu", "execution")]
    assert "handle 2" in r.deferred[1]["message"] and "aten::mm" in r.deferred[1]["message"]


def test_free_releases_a_handle(client):
    client.send_batch([free(1)], uploads=[(1, 0, torch.ones(3))])
    r = client.request([fetch(client.next_req(), 1)])
    assert r.error["kind"] == "handle" and "handle 1 is unknown" in r.error["message"]


def test_unknown_handle_in_an_op_is_a_deferred_error_not_a_crash(client):
    client.send_batch([op("aten::neg", [H(424242)], {}, [spec(1, torch.empty(1))])])
    r = client.sync()
    [err] = r.deferred
    assert err["kind"] == "handle" and "424242" in err["message"]
    assert client.sync().error is None


def test_declared_dtype_mismatch_poisons_the_output(client):
    client.send_batch([op("aten::add.Tensor", [H(1), H(1)], {}, [spec(2, torch.empty(3, dtype=torch.float64))])],
                      uploads=[(1, 0, torch.ones(3))])
    r = client.request([fetch(client.next_req(), 2)])
    [err] = r.deferred
    assert err["kind"] == "mismatch"
    assert err["message"].startswith("server and client disagree on the output of aten::add.Tensor")
    assert "torch.float32" in err["message"] and "torch.float64" in err["message"]
    assert r.error is not None and "disagree" in r.error["message"]


def test_declared_shape_mismatch_is_reported(client):
    client.send_batch([op("aten::add.Tensor", [H(1), H(1)], {}, [spec(2, torch.empty(4))])],
                      uploads=[(1, 0, torch.ones(3))])
    [err] = client.sync().deferred
    assert err["kind"] == "mismatch" and "[3]" in err["message"] and "[4]" in err["message"]


def test_declared_stride_of_a_fresh_output_is_honoured(client):
    x = torch.arange(6.0).reshape(2, 3)
    declared = torch.empty_strided((2, 3), (1, 2))  # column-major
    client.send_batch([op("aten::mul.Scalar", [H(1), 2.0], {}, [spec(2, declared)]),
                       call(client.next_req(), "aten::stride.int", [H(2), 0]),
                       call(client.next_req(), "aten::stride.int", [H(2), 1])], uploads=[(1, 0, x)])
    first, second = client.reply(), client.reply()
    assert first.error is None and first.deferred == [] and [first.result, second.result] == [1, 2]
    torch.testing.assert_close(client.fetch(2), x * 2)


def test_declared_stride_mismatch_on_a_view_is_an_error(client):
    x = torch.zeros(2, 3)
    client.send_batch([op("aten::t", [H(1)], {}, [spec(2, torch.empty(3, 2))])], uploads=[(1, 0, x)])
    [err] = client.sync().deferred
    assert err["kind"] == "mismatch" and "view" in err["message"]


def test_forbidden_op_is_a_deferred_error_and_the_session_goes_on(client):
    client.send_batch([op("aten::from_file", ["/etc/passwd"], {}, [spec(1, torch.empty(1))])])
    r = client.request([sync(client.next_req())], uploads=[(2, 0, torch.ones(2))])
    [err] = r.deferred
    assert err["kind"] == "forbidden" and "reads a file" in err["message"]
    assert client.fetch(2).tolist() == [1.0, 1.0]


def test_goodbye_ends_the_session_cleanly(genie_serve):
    with RawClient(genie_serve.port) as c:
        c.handshake()
        c.goodbye()
        with pytest.raises(Exception, match="closed"):
            c.recv()
