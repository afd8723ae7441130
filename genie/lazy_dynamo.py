"""Keep torch's Python kernels from importing ``torch._dynamo`` while nothing can be traced.

torch wraps many Python kernels (the reference and decomposition kernels behind meta tensors, the elementwise
references such as ``rsqrt``, fake-tensor modes) in ``torch._compile._disable_dynamo``. That wrapper imports dynamo
on its first call, only to build a ``dynamo.disable`` of the function, which it caches on the function as
``__dynamo_disable``: about 800 modules, 1 to 3 s of a core, paid by the first op that reaches such a kernel (the
client's meta inference of a layer norm or an ``rsqrt``, a session worker's pre-flight). Before dynamo is imported no
frame can be traced, so the wrapper has nothing to do: :func:`defer` pre-fills each wrapped function's cache with a
stand-in that calls it directly while dynamo is absent and installs torch's real ``disable`` once something else
(``torch.compile``) has imported it. Client (:mod:`genie.device.meta`) and node (the session workers' warm-up) both
use it. Imports no dynamo, only torch.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
from typing import Any

_deferred = False
_lock = threading.Lock()


def _stand_in(fn: Any, recursive: bool) -> Any:
    """Stands in for ``torch._dynamo.disable(fn)`` until dynamo is imported by someone else."""

    def call(*args: Any, **kwargs: Any) -> Any:
        disable = getattr(sys.modules.get("torch._dynamo"), "disable", None)
        if disable is None:
            # Without dynamo no frame is being traced: disabling it is a no-op, so fn runs as it is.
            return fn(*args, **kwargs)
        real = disable(fn, recursive, wrapping=False)
        setattr(fn, "__dynamo_disable", real)  # what torch's wrapper would have cached: from now on it is used
        return real(*args, **kwargs)

    return call


def defer() -> int:
    """Give every ``_disable_dynamo`` wrapper that exists now a stand-in (see the module's docstring); runs once,
    and not at all once dynamo is imported. Returns the functions covered.

    The wrappers are found by their code object among the collector's objects (about 0.05 s after ``import torch``),
    so the ones that torch's factories build inside other functions (the elementwise references) are covered too.
    Wrappers created later, by modules imported later, import dynamo on first use as torch has them do.
    """
    global _deferred
    if _deferred:  # the common case (every meta run asks): no lock
        return 0
    with _lock:
        covered = 0 if _deferred or "torch._dynamo" in sys.modules else _cover()
        _deferred = True
    return covered


def _cover() -> int:
    import torch._compile

    code = torch._compile._disable_dynamo(len).__code__  # every wrapper shares this code object
    covered = 0
    for obj in gc.get_objects():
        if type(obj) is not types.FunctionType or obj.__code__ is not code:
            continue
        cells = dict(zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True))
        fn, recursive = cells["fn"].cell_contents, cells["recursive"].cell_contents
        if getattr(fn, "__dynamo_disable", None) is None:
            try:
                setattr(fn, "__dynamo_disable", _stand_in(fn, recursive))
            except (AttributeError, TypeError):  # a callable without attributes: it keeps torch's way
                continue
            covered += 1
    return covered
