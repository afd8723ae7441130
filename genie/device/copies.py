"""Ops with their own rules: copies between host and device, ``resize_`` and ``set_``.

``tensor.to(device)`` is ATen's own ``_to_copy``: an ``empty`` (a C++ kernel: a new storage
id, no round trip) and a ``copy_`` that arrives here as ``_copy_from``. A copy that fills a
whole fresh storage is a plain upload under that storage's id; anything else uploads into a
temporary storage and queues a server-side ``copy_``. Large uploads of parameters may be named
by content key instead (the node's weight cache: :mod:`genie.device.transfers`). Device to host is a FETCH (one round
trip), unless the storage has a host shadow (:mod:`genie.device.shadows`): small uploads keep one, and
every copy here keeps the destination's shadow true or drops it. Copies between two remote devices
never pass through this client: inside the node that holds both, or node to node
(:mod:`genie.device.peers`).
"""

from __future__ import annotations

from typing import Any

import torch

from genie import _C
from genie.device import dispatch, peers, shadows
from genie.device.registry import RemoteDevice, table

_aten = torch.ops.aten


def _is_remote(t: torch.Tensor) -> bool:
    return t.get_device() >= 0


def download(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A remote tensor's values in ``out`` (a contiguous CPU tensor of its dtype and shape) or a new one (a sync point)."""
    device = table().get(t.get_device())
    if out is None:
        out = torch.empty(tuple(t.shape), dtype=t.dtype)
    if out.numel() == 0:
        return out
    if shadows.TABLE.entries and device.connection.lost is None:
        known = shadows.read(t)
        if known is not None:
            return out.copy_(known)
    return device.connection.fetch(device.local_index, dispatch.descriptor(t), out, device=device.label)


def _receivable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a fetch of ``src`` may land in ``dst``'s memory as it is: no staging tensor, no second copy."""
    return (dst.dtype == src.dtype and tuple(dst.shape) == tuple(src.shape) and dst.is_contiguous()
            and not dst.is_conj() and not dst.is_neg() and not dst.requires_grad)


def _covers_storage(t: torch.Tensor) -> bool:
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def upload_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Host -> device: ``dst.copy_(src)`` for a CPU ``src``."""
    device = table().get(dst.get_device())
    conn = device.connection
    by_key = conn.content is not None and conn.content.wants(src)  # the weight cache: before detach drops grad
    requires_grad = src.requires_grad  # a parameter: an optimizer writes it each step, so no host shadow
    src = src.detach()
    if src.is_conj():
        src = src.resolve_conj()
    if src.is_neg():
        src = src.resolve_neg()
    if src.dim() == 0:
        if dst.numel():  # a fill: ATen's copy_ of a host tensor into a CUDA one waits for the device's stream
            _queue_copy(dst, src if src.dtype == dst.dtype else src.to(dst.dtype), device, "aten::fill_.Tensor")
        return
    if src.numel() == 0:
        if dst.numel():
            _queue_copy(dst, src, device)  # the node raises torch's own error (no broadcast from nothing)
        return
    if src.dtype == dst.dtype and tuple(src.shape) == tuple(dst.shape) and _covers_storage(dst):
        conn.upload(_C.storage_id(dst), device.local_index, src.contiguous(), overwrite=True, by_key=by_key)
        shadows.after_upload(dst, src, requires_grad=requires_grad)
        return
    tmp = torch.empty(tuple(src.shape), dtype=dst.dtype, device=dst.device)
    converted = src.to(dst.dtype).contiguous()
    conn.upload(_C.storage_id(tmp), device.local_index, converted, overwrite=False, by_key=by_key)
    shadows.after_upload(tmp, converted, requires_grad=requires_grad)
    _queue_copy(dst, tmp, device)


def _queue_copy(dst: torch.Tensor, src: torch.Tensor, device: RemoteDevice, name: str = "aten::copy_") -> None:
    """Queue ``dst.copy_(src)`` on the node, or ``dst.fill_(src)`` (``name``) for a 0-dim host ``src`` of
    ``dst``'s dtype: ATen's fill of a device tensor from a host scalar passes the value to the kernel, where its
    copy of host memory into CUDA memory synchronizes the stream."""
    device.connection.op(device.local_index, name, [dst, src], {}, [dispatch.descriptor(dst)],
                         dispatch.encoder_for(device))
    if shadows.TABLE.entries or shadows.TABLE.enabled:
        shadows.after_copy(dst, src)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` where at least one of them is remote."""
    if _is_remote(dst) and _is_remote(src):
        if src.get_device() == dst.get_device():
            if dst.numel():
                _queue_copy(dst, src, table().get(dst.get_device()))
            return dst
        if dst.numel():  # another device: node to node, or inside one node (genie.device.peers)
            peers.copy_between(dst, src, table().get(dst.get_device()), table().get(src.get_device()))
            if shadows.TABLE.entries or shadows.TABLE.enabled:
                shadows.after_copy(dst, src)
        return dst
    if _is_remote(dst):
        upload_into(dst, src)
        return dst
    if not dst.numel():
        return dst
    if _receivable(dst, src):
        # Device to host into a plain destination (``.cpu()``'s fresh tensor, a preallocated buffer):
        # the reply's bytes are received straight into it, not staged and copied over.
        download(src, dst.detach())
        return dst
    dst.copy_(download(src))
    return dst


def _copy_(func: Any, args: Any, kwargs: Any) -> Any:
    return copy_into(args[0], args[1])


def _copy_from(func: Any, args: Any, kwargs: Any) -> Any:
    return copy_into(args[1], args[0])


def _copy_from_and_resize(func: Any, args: Any, kwargs: Any) -> Any:
    src, dst = args[0], args[1]
    if tuple(dst.shape) != tuple(src.shape):
        dst.resize_(src.shape)
    return copy_into(dst, src)


# -- layout changes -------------------------------------------------------------------------------
def _resize_(func: Any, args: Any, kwargs: Any) -> Any:
    t, size = args[0], [int(s) for s in args[1]]
    memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
    if memory_format is None or memory_format == torch.preserve_format:
        memory_format = torch.contiguous_format
    stride = torch.empty(0, device="meta").resize_(size, memory_format=memory_format).stride()
    dispatch.set_layout(t, size, stride, t.storage_offset())
    return t


def _set_empty(func: Any, args: Any, kwargs: Any) -> Any:
    t = args[0]
    empty = torch.empty(0, dtype=t.dtype, device=t.device)
    _aten.set_.source_Storage_storage_offset(t, empty.untyped_storage(), 0, [0], [1])
    return t


def _set_source_tensor(func: Any, args: Any, kwargs: Any) -> Any:
    t, src = args[0], args[1]
    _aten.set_.source_Storage_storage_offset(t, src.untyped_storage(), src.storage_offset(), list(src.shape),
                                             list(src.stride()))
    return t


def _false(func: Any, args: Any, kwargs: Any) -> bool:
    return False


dispatch.SPECIAL.update({
    _aten.copy_.default: _copy_,
    _aten._copy_from.default: _copy_from,
    _aten._copy_from_and_resize.default: _copy_from_and_resize,
    _aten.resize_.default: _resize_,
    _aten.set_.default: _set_empty,
    _aten.set_.source_Tensor: _set_source_tensor,
    _aten.is_pinned.default: _false,
})
