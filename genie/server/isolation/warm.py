"""Imported once by the zygote (``PRELOAD``): what a session's first op would otherwise import.

The pre-flight's first meta run (:mod:`genie.server.preflight`) pulls in some 800 modules
of torch (the meta and decomposition tables, sympy); a worker forked from a zygote without
them paid that, seconds on a loaded machine, at its session's first op. Importing this
module runs one pre-flight, so the zygote holds those modules and every worker starts with
them, sharing their pages.
"""

from __future__ import annotations

import torch

from genie.server import preflight
from genie.server.ops import resolve_op


def warm() -> None:
    """One pre-flight of a tiny op (its plan is cached like any other: it depends on shapes only)."""
    add = resolve_op("aten::add.Tensor")
    with torch.no_grad():
        preflight.check(add, "aten::add.Tensor", [torch.zeros(1), 1], {},
                        max_elements=preflight.DEFAULT_MAX_OP_ELEMENTS, remaining_bytes=None)


warm()
