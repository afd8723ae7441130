"""Which ops' float arguments may change their outputs' metadata: both sides key repeated ops by it.

The client's signature cache (genie.device.dispatch, genie/csrc/device/fastpath.cpp) and the node's command plans
(genie.server.plans) both remember per op signature what the first call found (output layouts; on the node
also the pre-flight's byte and element answer). An optimizer step sends the same ops with new float
scalars every time (step sizes, bias corrections), so both key those floats by type: one signature for
every step. That is sound only where a float's value never changes the outputs' dtype, shape or strides;
:func:`floats_decide_metadata` names the ops where it may, whose floats stay part of the signature by value.
"""

from __future__ import annotations

from typing import Any

#: Ops whose float arguments decide the outputs' shape: sizes from a range or a scale factor.
FLOAT_SHAPED_OPS = ("aten::arange", "aten::range", "aten::linspace", "aten::logspace", "aten::upsample_",
                    "aten::_upsample_", "aten::histogram", "aten::histc")


def floats_decide_metadata(name: str, schema: Any) -> bool:
    """Whether an op's float arguments (``float``, ``Scalar``, lists of them) may change its output metadata.

    Elementwise math, reductions, optimizer updates and losses take float values that change every
    step but never their outputs' dtype (the type of a Scalar decides that, and stays in the key),
    shape or strides. The exceptions are kept by value: ranges (``arange``, ``linspace``), upsampling
    scale factors, histograms, any argument named like a scale or size, and ops that return numbers
    (the cached number would be stale).
    """
    if name.startswith(FLOAT_SHAPED_OPS):
        return True
    for a in schema.arguments:
        if "float" in str(a.type) and ("scale" in a.name or "size" in a.name):
            return True
    return any(not str(r.type).startswith("Tensor") and "Tensor" not in str(r.type) for r in schema.returns)
