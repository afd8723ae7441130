"""Makes ``remote_accelerator`` a real PyTorch device (PrivateUse1, renamed).

Done once per process, on first use: rename PrivateUse1, register the Python
device guard and hooks, the ``torch.remote_accelerator`` device module, a
PrivateUse1 fallback kernel (factories and ``.to()`` arrive there, before any
RemoteTensor exists) and explicit ``_copy_from`` kernels (the Python fallback
trips an internal assert when an argument already has a Python object).
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch
import torch.utils.backend_registration as backend_registration

from genie.device import registry
from genie.device.tensor import BACKEND, RemoteTensor, _rebuild_remote, execute

_lock = threading.Lock()
_done = False
_libraries: list[Any] = []


def _device_count() -> int:
    try:
        return len(registry.table())
    except Exception:
        return 0


def _synchronize(device: Any = None) -> None:
    """Wait until every op sent to ``device`` (default: all devices) has run; raise deferred errors."""
    tbl = registry.table()
    if device is None:
        conns = tbl.connections()
    else:
        index = device if isinstance(device, int) else torch.device(device).index
        conns = [tbl.get(index).connection]
    for conn in conns:
        conn.sync()


def _make_device_module() -> types.ModuleType:
    mod = types.ModuleType(f"torch.{BACKEND}", "genie's remote_accelerator device module")
    mod.is_available = lambda: _device_count() > 0  # type: ignore[attr-defined]
    mod.is_initialized = lambda: _device_count() > 0  # type: ignore[attr-defined]
    mod.device_count = _device_count  # type: ignore[attr-defined]
    mod.current_device = registry.current_index  # type: ignore[attr-defined]
    mod.set_device = lambda d: registry.set_current_index(d if isinstance(d, int) else torch.device(d).index or 0)  # type: ignore[attr-defined]
    mod.synchronize = _synchronize  # type: ignore[attr-defined]
    mod._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    mod.manual_seed_all = lambda seed: None  # type: ignore[attr-defined]
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]  # type: ignore[attr-defined]
    return mod


class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc]
    def is_available(self) -> bool:
        return _device_count() > 0

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):  # type: ignore[misc]
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    return execute(op, args, kwargs)


def _copy_from_kernel(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return execute(torch.ops.aten._copy_from.default, (src, dst, non_blocking), {})


def _copy_from_and_resize_kernel(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if tuple(dst.shape) != tuple(src.shape):
        dst.resize_(src.shape)
    return execute(torch.ops.aten._copy_from.default, (src, dst, False), {})


def ensure_registered() -> None:
    """Register the device once per process (idempotent, thread-safe)."""
    global _done
    with _lock:
        if _done:
            return
        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", BACKEND):
            from genie.errors import DeviceError

            raise DeviceError(
                f"PrivateUse1 is already taken by {torch._C._get_privateuse1_backend_name()!r}; "
                "genie's remote_accelerator cannot share a process with another PrivateUse1 backend"
            )
        backend_registration._setup_privateuseone_for_python_backend(
            rename=BACKEND, backend_module=_make_device_module(), hook=_Hooks(), device_guard=_Guard()
        )
        lib = torch.library.Library("_", "IMPL")  # noqa: TOR901 - fallback needs the catch-all library
        lib.fallback(_fallback, "PrivateUse1")
        aten_lib = torch.library.Library("aten", "IMPL")
        aten_lib.impl("_copy_from", _copy_from_kernel, "PrivateUse1")
        aten_lib.impl("_copy_from_and_resize", _copy_from_and_resize_kernel, "PrivateUse1")
        _libraries.extend([lib, aten_lib])
        torch.serialization.add_safe_globals([_rebuild_remote, RemoteTensor])
        _done = True
