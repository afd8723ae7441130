"""Real third-party models (Hugging Face transformers, built from configs with random weights, no
downloads) train and generate on the remote device exactly enough like on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

D0 = "remote_accelerator:0"

pytestmark = [pytest.mark.usefixtures("remote"), pytest.mark.slow]


def _gpt2() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 8))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def _t5() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg), {"input_ids": torch.randint(1, 64, (2, 7)),
                                                          "labels": torch.randint(1, 64, (2, 5))}


def _vit() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=5,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 16, 16),
                                                         "labels": torch.tensor([1, 3])}


def _resnet() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic", num_labels=5)
    return transformers.ResNetForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32),
                                                            "labels": torch.tensor([0, 4])}


def _train(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: str) -> tuple[list[float], list[torch.Tensor]]:
    model = copy.deepcopy(model).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {k: v.to(device) for k, v in batch.items()}
    losses: list[float] = []
    grads: list[torch.Tensor] = []
    for step in range(3):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
        opt.step()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("make", [_gpt2, _t5, _vit, _resnet], ids=["gpt2", "t5", "vit", "resnet"])
def test_forward_backward_and_three_adamw_steps_match_cpu(make) -> None:
    torch.manual_seed(0)
    model, batch = make()
    cpu_losses, cpu_grads = _train(model, batch, "cpu")
    remote_losses, remote_grads = _train(model, batch, D0)
    torch.testing.assert_close(torch.tensor(remote_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
    assert len(remote_grads) == len(cpu_grads) > 0
    for r, c in zip(remote_grads, cpu_grads, strict=True):
        torch.testing.assert_close(r, c, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("make", [_gpt2, _t5], ids=["gpt2", "t5"])
def test_greedy_generate_equals_cpu(make) -> None:
    torch.manual_seed(0)
    model, batch = make()
    model.eval()
    ids = batch["input_ids"]
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        cpu = model.generate(ids, **kwargs)
        remote = copy.deepcopy(model).to(D0).generate(ids.to(D0), **kwargs)
    assert remote.device == torch.device(D0)
    assert torch.equal(remote.cpu(), cpu)
