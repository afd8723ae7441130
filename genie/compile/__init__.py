"""``torch.compile`` for remote tensors: graphs shipped once, replayed on the server.

Quick start::

    model = MyModel().to("remote_accelerator:0")
    compiled = torch.compile(model, backend="genie")
    loss = compiled(x).sum()        # one command per graph call, forward and backward
    loss.backward()

The ``genie`` backend (registered with dynamo through the ``torch_dynamo_backends`` entry point)
lowers each FX graph with AOTAutograd, as ``backend="aot_eager"`` does, and sends each forward
and backward aten graph once to the server, which validates it op by op and keeps it for the
session; each call is then one ``CMD_REPLAY`` carrying input descriptors
(:mod:`genie.compile.replay`). A graph the server cannot replay runs op by op, with the reason
logged on ``genie.compile``. ``torch.compile(model)`` with the default backend (inductor) on
remote tensors uses this backend too (:mod:`genie.compile.inductor`).

Nothing here imports dynamo until a graph is compiled: this package is imported when the device
registers, at ``import torch``.
"""

from __future__ import annotations

from typing import Any


def genie_backend(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
    """The dynamo backend ``"genie"`` (``torch.compile(model, backend="genie")``)."""
    from genie.compile.backend import compile_model

    return compile_model(gm, example_inputs, **kwargs)


__all__ = ["genie_backend"]
