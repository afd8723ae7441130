"""Weight normalisation's fused kernels as ordinary ops on the client.

``torch._weight_norm`` (``nn.utils.weight_norm``, ``nn.utils.parametrizations.weight_norm``: wav2vec2's
and HuBERT's positional convolution, WaveNet-style vocoders) calls ``_weight_norm_interface`` when the
norm runs over the first or the last dimension; its autograd formula calls
``_weight_norm_interface_backward``. Their CPU kernels walk ``v``, ``g`` and the norms as dense arrays
of the sizes ``v`` gives, whatever the strides and sizes of the tensors actually passed, so the server
does not allow them (a sent call could read past a storage). Here each runs as the same arithmetic in
ordinary, allowed ops (the math of aten/src/ATen/native/cpu/WeightNormKernel.cpp, accumulating in
float32 for reduced-precision inputs, as the kernel does); autograd's graph stays torch's own.
"""

from __future__ import annotations

from typing import Any

import torch

from genie.device import dispatch

_aten = torch.ops.aten


def _other_dims(v: torch.Tensor, dim: int) -> list[int]:
    if dim not in (0, v.dim() - 1):
        raise RuntimeError(f"_weight_norm_interface: fused kernels can only be applied for the first or the last "
                           f"dimension, got dim={dim} for a {v.dim()}-dim tensor; call torch._weight_norm instead")
    return [d for d in range(v.dim()) if d != dim]


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _norm(v: torch.Tensor, dims: list[int]) -> torch.Tensor:
    # vector_norm over dim=[] would reduce every dimension; a 1-dim v's "rows" are single elements
    return torch.linalg.vector_norm(v, 2, dim=dims, keepdim=True) if dims else v.abs()


def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``_weight_norm_interface``: (w = v * g / ||v||, the norms in g's shape; float32 for a bfloat16 g)."""
    vf = _acc(v)
    norm = _norm(vf, _other_dims(v, dim))
    w = vf * (_acc(g).reshape(norm.shape) / norm)
    norm_dtype = torch.float32 if g.dtype == torch.bfloat16 else g.dtype
    return w.to(v.dtype), norm.reshape(g.shape).to(norm_dtype)


def weight_norm_backward(grad_w: torch.Tensor, saved_v: torch.Tensor, saved_g: torch.Tensor,
                         saved_norms: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_weight_norm_interface_backward``: (grad of v, grad of g)."""
    dims = _other_dims(saved_v, dim)
    v, grad = _acc(saved_v), _acc(grad_w)
    norm = _acc(saved_norms).reshape(_norm(v, dims).shape)
    per_row = (grad * v).sum(dims, keepdim=True) if dims else grad * v
    g = _acc(saved_g).reshape(norm.shape)
    grad_v = (g / norm) * (grad - v * (per_row / (norm * norm)))
    grad_g = per_row / norm
    return grad_v.to(saved_v.dtype), grad_g.reshape(saved_g.shape).to(saved_g.dtype)


def _composite(compute: Any) -> Any:
    def special(func: Any, args: Any, kwargs: Any) -> Any:
        names = [a.name for a in func._schema.arguments]
        given = dict(zip(names, args, strict=False)) | dict(kwargs)
        return compute(*(given[n] if n in given else a.default_value
                         for n, a in zip(names, func._schema.arguments, strict=True)))

    return special


dispatch.SPECIAL.update({
    _aten._weight_norm_interface.default: _composite(weight_norm),
    _aten._weight_norm_interface_backward.default: _composite(weight_norm_backward),
})
