"""The fused RNN cell kernels on a server whose device type has none (a CPU server).

ATen's ``LSTMCell``/``GRUCell`` (``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell``, ``nn.GRUCell``) take the fused
path for every CUDA, XPU and PrivateUse1 input: ``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``, whose
backward is ``_thnn_fused_lstm_cell_backward_impl`` / ``_thnn_fused_gru_cell_backward``. The test is
``input.is_privateuseone()`` in C++ (aten/src/ATen/native/RNN.cpp), so nothing the client can set picks
the CPU path instead, and a CPU server has no kernel for these four ops. So on a device whose server
kind is ``cpu`` each of them runs here as the same arithmetic in ordinary ops (the elementwise math of
CUDA's kernels in aten/src/ATen/native/cuda/RNN.cu, workspace layout included, so the forward's
workspace is what the backward reads); autograd's graph is the one CUDA builds. On a CUDA server the
fused kernels are sent as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from genie.device import dispatch, registry

_aten = torch.ops.aten


def _server_kind(t: torch.Tensor) -> str:
    return registry.device_at(t.get_device()).kind


def _given(op: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    return dict(zip(names, args, strict=False)) | dict(kwargs)


def _biased(gates: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gates if bias is None else gates + bias


def lstm_cell(igates: torch.Tensor, hgates: torch.Tensor, cx: torch.Tensor, input_bias: torch.Tensor | None,
              hidden_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_thnn_fused_lstm_cell``: (hy, cy, workspace), the workspace holding the activated gates [i, f, g, o]."""
    gates = _biased(_biased(igates + hgates, input_bias), hidden_bias)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor,
                       cy: torch.Tensor, workspace: torch.Tensor,
                       has_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``_thnn_fused_lstm_cell_backward_impl``: (grad of the gates, grad of cx, grad of the bias or None)."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_c = grad_cy if grad_cy is not None else torch.zeros_like(cy)
    if grad_hy is not None:
        grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + grad_c
        grad_o = grad_hy * tanh_cy * (1 - o) * o
    else:
        grad_o = torch.zeros_like(o)
    grad_gates = torch.cat([grad_c * g * (1 - i) * i, grad_c * cx * (1 - f) * f, grad_c * i * (1 - g * g),
                            grad_o], 1)
    return grad_gates, grad_c * f, grad_gates.sum(0) if has_bias else None


def gru_cell(igates: torch.Tensor, hgates: torch.Tensor, hx: torch.Tensor, input_bias: torch.Tensor | None,
             hidden_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``_thnn_fused_gru_cell``: (hy, workspace), the workspace holding [r, z, n, hx, the hidden n gate]."""
    ir, iz, in_ = _biased(igates, input_bias).chunk(3, 1)
    hr, hz, hn = _biased(hgates, hidden_bias).chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, hn], 1)


def gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool) -> tuple[Any, ...]:
    """``_thnn_fused_gru_cell_backward``: grads of (input gates, hidden gates, hx, input bias, hidden bias)."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * hn * (1 - r) * r
    grad_input = torch.cat([grad_r, grad_z, grad_n], 1)
    grad_hidden = torch.cat([grad_r, grad_z, grad_n * r], 1)
    if not has_bias:
        return grad_input, grad_hidden, grad_hy * z, None, None
    return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)


def _on_cpu_servers(compute: Any, names: tuple[str, ...]) -> Any:
    """A fallback entry: ``compute`` over the named arguments where the server is a CPU one, the op itself
    (sent whole) elsewhere."""
    def special(func: Any, args: Any, kwargs: Any) -> Any:
        given = _given(func, args, kwargs)
        first = next(v for v in given.values() if isinstance(v, torch.Tensor))
        if _server_kind(first) != "cpu":
            return dispatch.run_op(func, args, kwargs)
        return compute(*(given.get(name) for name in names))

    return special


dispatch.SPECIAL.update({
    _aten._thnn_fused_lstm_cell.default: _on_cpu_servers(
        lstm_cell, ("input_gates", "hidden_gates", "cx", "input_bias", "hidden_bias")),
    _aten._thnn_fused_lstm_cell_backward_impl.default: _on_cpu_servers(
        lstm_cell_backward, ("grad_hy", "grad_cy", "cx", "cy", "workspace", "has_bias")),
    _aten._thnn_fused_gru_cell.default: _on_cpu_servers(
        gru_cell, ("input_gates", "hidden_gates", "hx", "input_bias", "hidden_bias")),
    _aten._thnn_fused_gru_cell_backward.default: _on_cpu_servers(
        gru_cell_backward, ("grad_hy", "workspace", "has_bias")),
})
