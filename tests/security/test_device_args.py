"""Device arguments only as device tags naming the node's own devices (protocol 2), against a real server process.

torch would take ``"meta"``, ``"cuda:0"`` or ``"cpu"`` as a ``Device`` argument; sent as plain strings they would
reach devices outside the node's list (GPUs outside ``--devices``). The server refuses them from the op's schema.
"""

from __future__ import annotations

import pytest
import torch

from tests.raw_client import Dev, RawClient, T, call

DEVICE_STRINGS = ["meta", "cuda:0", "cuda:7", "cpu", "cpu:1", 0]


@pytest.mark.parametrize("value", DEVICE_STRINGS, ids=[str(v) for v in DEVICE_STRINGS])
@pytest.mark.parametrize(("op", "positional"), [("aten::empty.memory_format", False), ("aten::ones", False),
                                                ("aten::_to_copy", False), ("aten::to.device", True)])
def test_device_named_by_string_or_number_is_refused(genie_serve, value, op, positional):
    like = torch.empty(4)
    with RawClient(genie_serve.port) as client:
        client.handshake()
        if op == "aten::_to_copy":
            args, kwargs = [T(1, like)], {"device": value}
        elif positional:
            args, kwargs = [T(1, like), value, torch.float32], {}
        else:
            args, kwargs = [[4]], {"device": value, "dtype": torch.float32}
        r = client.request([call(client.next_req(), op, args, kwargs, outs=[2])])
        assert r.error is not None and r.error["kind"] == "protocol", r
        assert "device tag" in r.error["message"] and repr(str(value)) in r.error["message"]
        # The session goes on; the same op with the device tag of the node's device 0 works.
        tag_kwargs = {**kwargs, "device": Dev(0)} if not positional else {}
        tag_args = [T(1, like), Dev(0), torch.float32] if positional else args
        r = client.request([call(client.next_req(), op, tag_args, tag_kwargs, outs=[3])])
        assert r.error is None, r.error
