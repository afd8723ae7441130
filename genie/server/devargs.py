"""Device arguments: only device tags naming this node's devices, never strings or numbers.

A client names a device only with the device tag (:func:`genie.wire.values.device_ext`):
an index into the node's own device list, which the codec turns into that
``torch.device``. torch itself would also take ``"meta"``, ``"cuda:3"`` or ``3`` for
an argument typed ``Device``; accepted from the wire, such a value would run on
devices the node does not serve (GPUs outside ``--devices``, the meta device).
:func:`check_device_args` refuses them, from the op's schema, before it runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from genie.errors import ProtocolError


def _names_a_device(kind: Any) -> bool:
    """True for ``Device``, ``Device?`` and lists of them."""
    name = kind.kind()
    if name in ("OptionalType", "ListType"):
        return _names_a_device(kind.getElementType())
    return bool(name == "DeviceObjType")


@functools.lru_cache(maxsize=4096)
def device_params(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of each argument of ``op`` typed Device (position -1: keyword-only)."""
    return tuple((-1 if arg.kwarg_only else i, arg.name) for i, arg in enumerate(op._schema.arguments)
                 if _names_a_device(arg.type))


def check_device_args(op: torch._ops.OpOverload, label: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """ProtocolError when a Device-typed argument (resolved) is anything but a node device or None."""
    for position, name in device_params(op):
        values = []
        if 0 <= position < len(args):
            values.append(args[position])
        if name in kwargs:
            values.append(kwargs[name])
        for value in values:
            items = value if isinstance(value, list | tuple) else [value]
            for item in items:
                if item is not None and not isinstance(item, torch.device):
                    raise ProtocolError(
                        f"{label}: argument {name!r} is {str(item)[:40]!r}; a device is sent only as a device tag "
                        "naming one of this node's devices (its index), never as a string or number")
