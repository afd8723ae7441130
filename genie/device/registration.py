"""Makes ``remote_accelerator`` a real PyTorch device (PrivateUse1, renamed).

Done once per process, when :mod:`genie.device` is imported: rename PrivateUse1, load
``genie._C`` (allocator, device guard, hooks, metadata kernels, autocast lists), register the
``torch.remote_accelerator`` module and the Python fallback that turns every other op into a
command, and start autograd's engine while the guard reports room for every device index we
may use (the engine sizes its per-device queues once, at its first backward; on a host with a
CUDA driver that waits for ``genie.init()``, see :func:`prime_autograd`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from genie import _C
from genie.compile import inductor as _inductor
from genie.device import arguments, dispatch, module
from genie.device import copies as _copies  # noqa: F401 - fills dispatch.SPECIAL
from genie.device import graphs as _graphs
from genie.device import rnn_cells as _rnn_cells  # noqa: F401 - fills dispatch.SPECIAL (fused RNN cells)
from genie.device import weight_norm as _weight_norm  # noqa: F401 - fills dispatch.SPECIAL (weight norm kernels)
from genie.errors import DeviceError
from genie.local_cuda import local_cuda_here
from genie.wire.values import DTYPES

log = logging.getLogger("genie.device")

_lock = threading.Lock()
_done = False
_primed = False
_libraries: list[Any] = []


#: Ops whose composite kernels pick a backend-specific path PrivateUse1 lacks
#: (``convolution_overrideable``), and ops with CPU and CUDA kernels whose CompositeExplicitAutograd
#: kernel (``math_native_layer_norm``, ``math_group_norm``, ``math_addr``) would otherwise run for
#: PrivateUse1 on the client, as several ops rounding each intermediate to a float16/bfloat16 result
#: where the server's kernel (and CUDA's) accumulates in float32: sent to the server whole instead.
WHOLE_OPS = ("convolution", "convolution_backward", "native_layer_norm", "native_group_norm", "addr", "addr.out",
             "_scaled_dot_product_fused_attention_overrideable",
             "_scaled_dot_product_fused_attention_overrideable_backward")


def _cuda_driver_here() -> bool:
    """Whether priming would initialise a CUDA driver on this host (checked without initialising it).

    Autograd's engine asks every device type for its count when it starts, and CUDA answers by
    initialising its driver. A process that has done so cannot use CUDA in a ``fork()``ed child
    ("CUDA error: initialization error"): ``genie serve``'s session workers are such children of a
    zygote that imported torch, and so are a user's forked data workers. torch itself never
    initialises CUDA at import, so neither may genie.
    """
    return not torch.cuda.is_initialized() and local_cuda_here()


def prime_autograd() -> None:
    """Start autograd's engine while the guard reports the maximum device count (once per process).

    Autograd's engine starts its device threads once, sized by the largest deviceCount() of the
    registered device guards at that moment; a CPU backward before ``genie.init()`` would
    otherwise leave no queue for ``remote_accelerator:N`` and remote backward would fail.
    Registration does this at import, except on a host with a CUDA driver (see
    :func:`_cuda_driver_here`), where ``genie.init()`` does it instead: there a backward run before
    ``genie.init()`` sizes the engine by the local GPU count.
    """
    global _primed
    with _lock:
        if _primed:
            return
        _primed = True
    _C.set_max_devices(int(os.environ.get("GENIE_MAX_DEVICES", "16")))
    _C.set_priming(True)
    try:
        x = torch.ones(1, requires_grad=True)
        (x * 2).sum().backward()
    finally:
        _C.set_priming(False)


def ensure_registered() -> None:
    """Register the device once per process (idempotent, thread-safe)."""
    global _done
    with _lock:
        if _done:
            return
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", dispatch.BACKEND):
            raise DeviceError(
                f"PrivateUse1 is already taken by {name!r}; "
                "genie's remote_accelerator cannot share a process with another PrivateUse1 backend"
            )
        if name != dispatch.BACKEND:
            torch.utils.rename_privateuse1_backend(dispatch.BACKEND)
        _C.install()
        for code, dtype in enumerate(DTYPES):
            if dtype is not None:
                _C.set_dtype_code(dtype, code)
        torch._register_device_module(dispatch.BACKEND, module.make_module())
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
        # genie._C registers the PrivateUse1 fallback (genie/csrc/device/fastpath.cpp): signatures it learned are
        # queued natively, the rest come here.
        _C.set_python_fallback(dispatch.fallback, dispatch.overload_of)
        _C.whole_ops(list(WHOLE_OPS))  # their kernel is genie's fallback (with its fast path), as for every other op
        # Sparse and quantized tensors of the device (and factories asking for them) fail with a GenieError
        # naming the layout instead of torch's "Could not run ... 'Sparseremote_accelerator' backend".
        refusals = torch.library.Library("_", "IMPL")  # noqa: TOR901
        for key in arguments.UNSUPPORTED_KEYS:
            refusals.fallback(arguments.refuse_dispatch_key(key), dispatch_key=key)
        _libraries.append(refusals)
        _C.set_sync_hook(module._sync_hook)
        _C.set_resize_hook(dispatch.resize_hook)  # storage resizes (genie/csrc/device/allocator.cpp)
        _inductor.install()  # torch.compile's default backend hands remote graphs to backend="genie"
        _graphs.install()  # torch.accelerator.Graph on the device (genie/csrc/device/graph.cpp)
        _done = True
    if local_cuda_here():
        log.warning(
            "remote_accelerator is now torch's accelerator in this process, so a backward over local CUDA "
            "tensors in this process fails inside PyTorch ('opt_ready_stream && opt_parent_stream INTERNAL "
            "ASSERT FAILED', pytorch/pytorch#161129: autograd takes its streams from one accelerator). Train on "
            "the local GPU in a process that does not use genie's device.")
    if not _cuda_driver_here():
        prime_autograd()


def autoload() -> None:
    """torch's device-backend autoload (entry point group ``torch.backends``, through :mod:`genie.autoload`,
    which leaves hosts with a local GPU alone): ``import torch`` registers the device in every process of an
    environment where genie is installed, as torch_npu does.

    So ``torch.device("remote_accelerator:1")``, ``torch.load(map_location=...)`` and a CPU
    ``backward()`` that runs before ``import genie`` all meet a registered device. A failure here
    must not break ``import torch`` for every program of the environment: it is logged, and
    ``genie.init()`` raises it. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns autoloading off (then
    ``genie.init()`` registers the device).
    """
    try:
        ensure_registered()
    except Exception as exc:  # never break `import torch`
        log.warning("genie's remote_accelerator device was not registered at torch import: %s", exc)
