"""``torch.compile(model)`` (the default backend, inductor) on remote tensors.

Inductor generates C++/Triton kernels for the devices it knows; for ``remote_accelerator`` it
fails deep inside its passes with an internal assert. Instead, a graph whose inputs are remote
is handed to genie's backend (replayed on the server), with one warning per process saying so
and naming ``backend="genie"``. Graphs without remote inputs still go to inductor unchanged.

torch calls inductor through ``torch._TorchCompileInductorWrapper``; its ``__call__`` is wrapped
once, when the device registers. Nothing is imported from inductor or dynamo here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("genie.compile")

_warned = False


def _has_remote_input(inputs: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "remote_accelerator" for t in inputs)


def install() -> None:
    """Route the default backend's remote graphs to genie's backend (idempotent)."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None or getattr(wrapper.__call__, "_genie", False):
        return
    original = wrapper.__call__

    def __call__(self: Any, model_: Any, inputs_: Any, *args: Any, **kwargs: Any) -> Any:
        if not _has_remote_input(inputs_):
            return original(self, model_, inputs_, *args, **kwargs)
        global _warned
        if not _warned:
            _warned = True
            log.warning("torch.compile's default backend (inductor) cannot generate kernels for remote_accelerator; "
                        "this graph and later ones on the device use backend='genie' (replayed on the server) and "
                        "inductor options do not apply. Pass backend='genie' to say so, or backend='aot_eager' to "
                        "run op by op.")
        from genie.compile.backend import compile_model

        return compile_model(model_, inputs_)

    __call__._genie = True  # type: ignore[attr-defined]
    wrapper.__call__ = __call__
