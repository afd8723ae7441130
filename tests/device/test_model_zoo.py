"""The model zoo: real architectures (Hugging Face transformers built from tiny configs with random
weights, no downloads; torch.nn recurrent and convolutional models) train, evaluate and take a mixed-
precision step on remote_accelerator as they do on the CPU (issue 29's completeness gate, models).

Each model is built once on the CPU with a fixed seed; one deep copy trains on the CPU, another on
``remote_accelerator:0`` of the shared test server. Three checks per model:

- **train**: three AdamW steps; the losses, the first step's gradients, and the parameters and buffers
  after the last step equal the CPU's (BatchNorm's running statistics included);
- **eval**: ``model.eval()`` and a forward pass under ``torch.no_grad``; the outputs equal the CPU's;
- **amp**: one ``torch.autocast`` step in bfloat16 with ``torch.amp.GradScaler``; the scaled step runs,
  the loss is finite and close to the CPU's autocast loss, and the parameters move as the CPU's do.
  Autocast's op lists differ between the CPU and a PrivateUse1 device (the device takes CUDA's), so
  the amp check's tolerance is bfloat16's, not float32's.

A case that fails because the server refuses an op on purpose is listed in tests/device/deny_list.toml
(``zoo`` entries) and marked ``xfail(strict=True)`` here, so it fails as soon as the op works.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

D0 = "remote_accelerator:0"
SEED = 29

pytestmark = [pytest.mark.usefixtures("remote")]

Batch = dict[str, torch.Tensor]
#: (model, batch, loss of model on batch, the eval output of model on batch)
Built = tuple[nn.Module, Batch, Callable[[nn.Module, Batch], torch.Tensor], Callable[[nn.Module, Batch], Any]]


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def _hf_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def _hf_t5_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).logits  # T5 needs the labels to make its decoder inputs


def bert() -> Built:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(1, 64, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # padding inside the batch: the attention mask is not all ones
    mask[2, 4:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
             "labels": torch.tensor([0, 2, 1])}
    return transformers.BertForSequenceClassification(cfg), batch, _hf_loss, _hf_logits


def gpt2() -> Built:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 8))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}, _hf_loss, _hf_logits


def t5() -> Built:
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    batch = {"input_ids": torch.randint(1, 64, (2, 7)), "labels": torch.randint(1, 64, (2, 5))}
    return transformers.T5ForConditionalGeneration(cfg), batch, _hf_loss, _hf_t5_logits


def llama() -> Built:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attention_dropout=0.0)
    ids = torch.randint(0, 64, (2, 8))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, _hf_loss, _hf_logits


def vit() -> Built:
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=5,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([1, 3])}
    return transformers.ViTForImageClassification(cfg), batch, _hf_loss, _hf_logits


def wav2vec2() -> Built:
    # The speech encoder: a strided conv feature extractor with group norm, a weight-normed positional
    # convolution (torch's parametrizations), then transformer layers; SpecAugment off (it draws with numpy).
    cfg = transformers.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=2, num_labels=4, apply_spec_augment=False,
                                      hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                      feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                                      classifier_proj_size=16)
    batch = {"input_values": torch.randn(2, 400), "labels": torch.tensor([0, 3])}
    return transformers.Wav2Vec2ForSequenceClassification(cfg), batch, _hf_loss, _hf_logits


class _Recurrent(nn.Module):
    """Embedding, a two-layer recurrent stack, a linear head over every step (a tagger)."""

    def __init__(self, cell: type[nn.LSTM] | type[nn.GRU], bidirectional: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.rnn = cell(16, 24, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(48 if bidirectional else 24, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


def _tagger_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(batch["ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["tags"].flatten())


def _tagger_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch["ids"])


def lstm() -> Built:
    batch = {"ids": torch.randint(0, 40, (3, 10)), "tags": torch.randint(0, 7, (3, 10))}
    return _Recurrent(nn.LSTM, bidirectional=False), batch, _tagger_loss, _tagger_logits


def gru() -> Built:
    batch = {"ids": torch.randint(0, 40, (3, 10)), "tags": torch.randint(0, 7, (3, 10))}
    return _Recurrent(nn.GRU, bidirectional=True), batch, _tagger_loss, _tagger_logits


def cnn() -> Built:
    # timm's models import torchvision, which this project does not install: a ResNet-like torch CNN
    # with BatchNorm (running statistics in train mode, used in eval mode) and a residual block.
    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2), Block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    batch = {"x": torch.randn(4, 3, 16, 16), "y": torch.tensor([0, 4, 2, 1])}
    return model, batch, lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"]), lambda m, b: m(b["x"])


MODELS: dict[str, Callable[[], Built]] = {
    "bert_padded": bert, "gpt2": gpt2, "t5": t5, "llama": llama, "vit": vit, "wav2vec2": wav2vec2,
    "lstm": lstm, "gru": gru, "cnn_batchnorm": cnn,
}

#: (model, check) -> the op the server refuses today and another change is making work (issue 29).
#: Strict: the case fails as soon as it passes, so the entry is removed with the fix.
KNOWN_REFUSALS: dict[tuple[str, str], str] = {}


def _build(name: str) -> Built:
    torch.manual_seed(SEED)
    return MODELS[name]()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _train(model: nn.Module, batch: Batch, loss_of: Callable[[nn.Module, Batch], torch.Tensor],
           device: str) -> tuple[list[float], list[torch.Tensor], dict[str, torch.Tensor]]:
    model = copy.deepcopy(model).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {k: v.to(device) for k, v in batch.items()}
    losses: list[float] = []
    grads: list[torch.Tensor] = []
    for step in range(3):
        opt.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        if step == 0:
            grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
        opt.step()
        losses.append(loss.item())
    return losses, grads, _state(model)


def _amp_step(model: nn.Module, batch: Batch, loss_of: Callable[[nn.Module, Batch], torch.Tensor],
              device: str) -> tuple[float, float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model).to(device)
    model.train()
    kind = torch.device(device).type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(kind, init_scale=2.0**10)
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(kind, dtype=torch.bfloat16):
        probe = torch.ones(2, 2, device=device)
        assert (probe @ probe).dtype == torch.bfloat16, f"autocast is not active on {device}"
        loss = loss_of(model, batch)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.float().item(), float(scaler.get_scale()), _state(model)


def _named(key: str) -> Callable[[str], str]:
    return lambda message: f"{key}: {message}"


def _case(name: str, check: str) -> Any:
    reason = KNOWN_REFUSALS.get((name, check))
    marks = [pytest.mark.xfail(strict=True, reason=f"issue 29: {reason}")] if reason else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_case(n, "train") for n in MODELS])
def test_three_adamw_steps_equal_cpu(name: str) -> None:
    model, batch, loss_of, _ = _build(name)
    cpu_losses, cpu_grads, cpu_state = _train(model, batch, loss_of, "cpu")
    losses, grads, state = _train(model, batch, loss_of, D0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
    assert len(grads) == len(cpu_grads) > 0
    for got, want in zip(grads, cpu_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    assert state.keys() == cpu_state.keys()
    for key in state:  # parameters after three steps, and buffers (BatchNorm's running statistics)
        torch.testing.assert_close(state[key], cpu_state[key], rtol=1e-3, atol=1e-4, msg=_named(key))


@pytest.mark.parametrize("name", [_case(n, "eval") for n in MODELS])
def test_eval_forward_equals_cpu(name: str) -> None:
    model, batch, _, output_of = _build(name)
    model.eval()
    with torch.no_grad():
        want = output_of(model, batch)
        got = output_of(copy.deepcopy(model).to(D0), {k: v.to(D0) for k, v in batch.items()})
    assert got.device == torch.device(D0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [_case(n, "amp") for n in MODELS])
def test_bfloat16_autocast_grad_scaler_step_runs_like_cpu(name: str) -> None:
    model, batch, loss_of, _ = _build(name)
    try:
        cpu_loss, cpu_scale, cpu_state = _amp_step(model, batch, loss_of, "cpu")
    except RuntimeError as exc:  # plain torch, no genie: oneDNN's bfloat16 LSTM needs AVX-512 (or AMX) on the CPU
        if "could not create a primitive descriptor" not in str(exc):
            raise
        pytest.skip(f"this CPU cannot run {name} under bfloat16 autocast in plain torch (oneDNN: {str(exc)[:80]}...): "
                    "no reference here, and a CPU server fails the same way")
    loss, scale, state = _amp_step(model, batch, loss_of, D0)
    assert math.isfinite(loss)
    assert scale == cpu_scale  # no inf/nan found in the scaled gradients on either side: the step was taken
    assert loss == pytest.approx(cpu_loss, rel=3e-2, abs=3e-2)
    before = _state(model)
    moved = [k for k in state if state[k].is_floating_point() and not torch.equal(state[k], before[k])]
    assert moved, "the scaled step changed no parameter"
    for key in state:  # one AdamW step moves each weight by about lr: bfloat16's differences stay well inside
        torch.testing.assert_close(state[key].float(), cpu_state[key].float(), rtol=2e-2, atol=2e-3,
                                   msg=_named(key))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_norm_fused_kernels_match_cpu(dtype: torch.dtype) -> None:
    # wav2vec2's positional convolution: _weight_norm_interface and its backward run as ordinary ops
    # (genie/device/weight_norm.py); first and last dimension, and a 1-dim weight.
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for shape, dim in [((6, 4, 3), 0), ((6, 4, 3), 2), ((5,), 0)]:
        torch.manual_seed(SEED)
        v = torch.randn(shape, dtype=dtype)
        g = torch.randn([n if d == dim else 1 for d, n in enumerate(shape)], dtype=dtype)
        w, norms = torch._weight_norm_interface(v, g, dim)
        got_w, got_norms = torch._weight_norm_interface(v.to(D0), g.to(D0), dim)
        assert (got_w.dtype, got_norms.dtype, got_norms.shape) == (w.dtype, norms.dtype, norms.shape)
        torch.testing.assert_close(got_w.cpu(), w, rtol=tol, atol=tol)
        torch.testing.assert_close(got_norms.cpu(), norms, rtol=tol, atol=tol)
        leaves = [t.clone().requires_grad_() for t in (v, g)]
        torch._weight_norm(leaves[0], leaves[1], dim).pow(2).sum().backward()
        remote = [t.to(D0).requires_grad_() for t in (v, g)]
        torch._weight_norm(remote[0], remote[1], dim).pow(2).sum().backward()
        for got, want in zip(remote, leaves, strict=True):
            assert got.grad is not None and want.grad is not None
            torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_multilabel_margin_loss_of_one_sample_matches_cpu(reduction: str) -> None:
    # Found by the ModuleInfo gate: a 1-dim input's unreduced loss is 0-dim from the CPU kernel, [1] from meta.
    x = torch.linspace(-1, 1, 10, requires_grad=True)
    target = torch.tensor([3, 0, -1, 1, 0, 0, 0, 0, 0, 0])
    want = nn.functional.multilabel_margin_loss(x, target, reduction=reduction)
    remote = x.detach().to(D0).requires_grad_()
    got = nn.functional.multilabel_margin_loss(remote, target.to(D0), reduction=reduction)
    assert got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want.detach())
    want.backward()
    got.backward()
    assert remote.grad is not None and x.grad is not None
    torch.testing.assert_close(remote.grad.cpu(), x.grad)
