"""Attention dropout draws from the session's generator (genie/server/rng.py, genie/server/sdpa.py).

Which attention ops reach the server with dropout_p > 0: with the client's own choice, none of the fused ones (a
CPU server's choice and a CUDA server's both keep the math path, whose dropout is native_dropout); a client may
still send the fused (overrideable) op with dropout itself, and the server runs it with the session's generator.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_sdpa import _Ops  # the recording dispatch mode of the attention tests (this directory is on sys.path)

from genie import _C
from genie.device import registry
from genie.testing import run_client

D0 = "remote_accelerator:0"
P = 0.3
#: what a client runs to draw attention dropout through the fused op (also run by a second client, below)
FUSED_DRAW = """
def fused_draw(seed, device):
    torch.manual_seed(seed)
    q = torch.zeros(2, 4, 64, 8, device=device)  # uniform attention weights: 1/64 each
    v = torch.eye(64).expand(2, 4, 64, 64).to(device)  # the output is the weights themselves: 0 where dropped
    out = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, q, v, None, 0.3)[0]
    return out.cpu()
"""
exec(FUSED_DRAW)  # noqa: S102 - the constant above, shared with the second client's script

pytestmark = [pytest.mark.usefixtures("remote")]


def _dropout_attention_ops() -> list[str]:
    q = torch.randn(2, 4, 8, 64, device=D0, requires_grad=True)
    with _Ops() as ops:
        F.scaled_dot_product_attention(q, q, q, dropout_p=P).sum().backward()
    return ops.names


@pytest.mark.cpu_server
def test_attention_with_dropout_reaches_the_server_as_native_dropout_for_either_server_kind() -> None:
    kinds = [d.kind for d in registry.table().devices]
    default = _dropout_attention_ops()
    try:
        _C.set_sdp_kinds(["cuda"] * len(kinds))  # the fused choice a CUDA server gets
        forced = _dropout_attention_ops()
    finally:
        _C.set_sdp_kinds(kinds)
    for names in (default, forced):
        assert "aten.native_dropout.default" in names, names
        assert not any("_scaled_dot_product" in n for n in names), names  # no fused op with dropout


def test_the_cpu_flash_kernel_refuses_dropout_so_it_draws_nothing() -> None:
    """Why _scaled_dot_product_flash_attention_for_cpu is not in GENERATORLESS: it cannot draw. A torch whose
    kernel accepts dropout fails here: then it must run with the session's generator (genie/server/rng.py)."""
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="dropout"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, P)


def test_fused_attention_dropout_drops_the_expected_fraction() -> None:
    out = fused_draw(7, D0)  # type: ignore[name-defined]  # noqa: F821 - defined by exec above
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - P) < 0.02, dropped  # 32,768 draws: the standard deviation is 0.0025
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (64 * (1 - P))))  # scaled by 1 / (1 - p)


def test_two_clients_seeded_alike_draw_the_same_fused_attention_dropout(cpu_server: Any) -> None:
    done = run_client(cpu_server.control_port, "import json\n" + FUSED_DRAW + """
print("DRAWS", json.dumps([fused_draw(s, "remote_accelerator:0").flatten().tolist() for s in (1234, 99)]))
""", timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("DRAWS "))
    other = [torch.tensor(d) for d in json.loads(line[len("DRAWS "):])]
    mine = fused_draw(1234, D0).flatten()  # type: ignore[name-defined]  # noqa: F821
    assert torch.equal(mine, other[0])  # another session, seeded alike: the same mask
    assert not torch.equal(mine, other[1])  # seeded differently: another mask
    assert torch.equal(mine, fused_draw(1234, D0).flatten())  # type: ignore[name-defined]  # noqa: F821


def test_fused_attention_backward_uses_the_forwards_dropout_mask() -> None:
    """The backward draws nothing: it rebuilds the forward's mask from the philox_seed output. Checked against
    torch's math path given that mask (its dropout_mask argument) on the client's CPU."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=gen) for _ in range(3))
    grad = torch.randn(2, 2, 8, 16, generator=gen)
    remote = [t.to(D0).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    results = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(*remote, None, 0.5, True)
    results[0].backward(grad.to(D0))
    seed = int(results[6].item())
    masks = torch.Generator().manual_seed(seed)
    keep = torch.empty(2, 2, 8, 8, dtype=torch.bool).bernoulli_(0.5, generator=masks)
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(*local, None, 0.5, True, dropout_mask=keep)
    out.backward(grad)
    torch.testing.assert_close(results[0].cpu(), out.detach())
    for r, c in zip(remote, local, strict=True):
        assert r.grad is not None
        torch.testing.assert_close(r.grad.cpu(), c.grad)


def _gpt2_step(seed: int) -> tuple[float, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.3, attn_implementation="sdpa")  # type: ignore[call-arg]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(D0).train()  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.arange(32).reshape(2, 16).remainder(64).to(D0)
    torch.manual_seed(seed)  # after the weights: only the dropout masks depend on it
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss.item(), model.transformer.h[0].attn.c_attn.weight.detach().cpu()


def test_manual_seed_reproduces_a_gpt2_training_step_with_attention_dropout() -> None:
    pytest.importorskip("transformers")
    loss, weight = _gpt2_step(11)
    again_loss, again_weight = _gpt2_step(11)
    other_loss, other_weight = _gpt2_step(12)
    assert loss == again_loss and torch.equal(weight, again_weight)
    assert loss != other_loss and not torch.equal(weight, other_weight)  # the attention dropout drew
