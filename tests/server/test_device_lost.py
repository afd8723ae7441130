"""A CUDA sticky error (a device-side assert, an illegal memory access) leaves the session's CUDA context
unusable: the server answers the op's error, then ends the session with an ERROR ``lost`` frame naming why,
so the client's next call raises RemoteDeviceLost instead of every later op failing with the same error.

This machine has no GPU: the CUDA error is SIMULATED by an error record carrying CUDA's own message (what
torch raises on a GPU server; seen there on 2026-11-26, docs/device-testing.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from genie.errors import RemoteDeviceLost
from genie.server.executor import Executor, context_lost
from genie.server.records import error
from genie.server.store import StorageStore
from genie.testing import wait_until
from genie.wire.frame import HEADER, MsgKind, decode_header, unpack_body
from tests.transport.transport_fakes import FakeChannel

ASSERT = ("CUDA error: device-side assert triggered\nSearch for `cudaErrorAssert' in https://docs.nvidia.com/cuda/"
          "cuda-runtime-api/group__CUDART__TYPES.html for more information.")


class RecordingChannel(FakeChannel):
    """The fake channel, keeping each frame the executor sends."""

    def __init__(self) -> None:
        super().__init__("test")
        self.frames: list[bytes] = []

    def sendv(self, buffers: Any) -> None:
        self.frames.append(b"".join(bytes(b) for b in buffers))

    def replies(self) -> list[Any]:
        out = []
        for frame in self.frames:
            header = decode_header(frame[:HEADER.size])
            assert header.kind == MsgKind.REPLY
            out.append(unpack_body(frame[HEADER.size:HEADER.size + header.body_len]))
        return out


def test_only_cuda_sticky_errors_lose_the_context() -> None:
    assert context_lost([error("aten::index.Tensor", [[3]], "execution", ASSERT)]) is not None
    illegal = "CUDA error: an illegal memory access was encountered"
    assert "illegal memory access" in (context_lost([None, error("aten::mm", [], "execution", illegal)]) or "")
    # An ordinary CUDA error (out of memory) and a CPU kernel's error keep the session going.
    assert context_lost([error("aten::mm", [], "execution", "CUDA error: out of memory")]) is None
    assert context_lost([error("aten::index.Tensor", [], "execution", "index 9 is out of bounds")]) is None


@pytest.mark.parametrize("how", ["call", "deferred"])
def test_simulated_cuda_device_side_assert_is_answered_then_ends_the_session(how: str) -> None:
    channel = RecordingChannel()
    ex = Executor(channel, StorageStore(), [torch.device("cpu")])
    record = error("aten::index.Tensor", [[3], [2]], "execution", ASSERT)
    with pytest.raises(RemoteDeviceLost, match=r"aten::index.Tensor failed with 'CUDA error: device-side assert "
                                                r"triggered'.*reconnect with genie.shutdown\(\) and genie.init\(\)"):
        if how == "call":
            ex.fail_call(5, record, [])
        else:  # an OP's error waits for the next reply
            ex.fail_outputs(record, [])
            ex.finish_call("aten::_local_scalar_dense", 5, 1.0, [])
    [reply] = channel.replies()  # the client gets the op's own error before the session ends
    req, err, _, deferred = reply
    assert req == 5 and [r["message"] for r in ([err] if err else deferred)] == [ASSERT]


def test_a_session_ending_on_a_lost_context_sends_error_lost() -> None:
    """The session turns RemoteDeviceLost into the ERROR frame the client maps to RemoteDeviceLost."""
    from genie.server.session import Session

    channel = RecordingChannel()
    session = Session(channel, session_id=1, welcome=lambda: {}, devices=[torch.device("cpu")], max_storages=8,
                      max_bytes=1 << 20, max_payload=1 << 20)
    session._handshake = lambda: True  # type: ignore[method-assign]

    def serve() -> None:
        raise RemoteDeviceLost("aten::index.Tensor failed with 'CUDA error: device-side assert triggered'")

    session._serve = serve  # type: ignore[method-assign]
    session.run()
    header = decode_header(channel.frames[-1][:HEADER.size])
    body = unpack_body(channel.frames[-1][HEADER.size:HEADER.size + header.body_len])
    assert header.kind == MsgKind.ERROR and body["code"] == "lost" and "device-side assert" in body["reason"]
    assert channel.closed


def test_simulated_lost_context_in_the_nodes_process_refuses_new_sessions(inproc_server, monkeypatch) -> None:
    """With sessions in the node's process (isolation none), one lost CUDA context is every session's: the
    node refuses new sessions, saying to restart it. SIMULATED: a CPU kernel's error stands in for CUDA's
    sticky error (this machine has no GPU), by classifying its message as one."""
    from genie.server import executor
    from tests.raw_client import RawClient, T, desc, op

    real = executor.context_lost

    def lost_on_shape_error(records):
        for record in records:
            if isinstance(record, dict) and "shape checks" in str(record.get("message", "")):
                return real([{**record, "message": ASSERT}])
        return None

    monkeypatch.setattr(executor, "context_lost", lost_on_shape_error)
    server = inproc_server(isolation="none")
    a, b = torch.ones(3), torch.ones(4)
    with RawClient(server.port) as c:
        c.handshake()
        c.send_batch([op("aten::add.Tensor", [T(1, a), T(2, b)], {}, [desc(3, a)])], uploads=[(1, 0, a), (2, 0, b)])
        reply = c.sync()
        assert "shape checks" in reply.deferred[0]["message"]  # the op's own error first
        kind, body, _ = c.recv()
        assert kind == MsgKind.ERROR and body["code"] == "lost" and "device-side assert" in body["reason"]
    # The node records the loss when the session's thread ends, just after that frame went out.
    wait_until(lambda: server.context_lost is not None, 5, what="the node to record the lost context")
    with RawClient(server.port) as late:
        kind, body = late.hello()
        assert kind == MsgKind.REJECT and "CUDA context is lost" in body["reason"] and "restart" in body["reason"]
