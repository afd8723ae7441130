"""Ordinary PyTorch code that CUDA runs is not refused by the server (issue 29), and matches the CPU.

Each case runs the same code on the CPU and on ``remote_accelerator:0`` (the shared test server) and compares
values; random ops compare exactly where the server computes on CPUs (its session generator is a CPU
generator seeded as the client's: docs/device.md), and by their distribution and reproducibility anywhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


def _run_both(module: nn.Module, inputs: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(outputs, parameter grads, input grads) of a forward and backward on the CPU and on the device."""
    results = []
    for device in ("cpu", D0):
        m = copy.deepcopy(module).to(device)
        xs = [x.detach().to(device).requires_grad_(x.is_floating_point()) for x in inputs]
        out = m(*xs)
        flat = [o for o in (out if isinstance(out, tuple) else (out,)) for o in (o if isinstance(o, tuple) else (o,))]
        sum((o.float() * (i + 1)).sum() for i, o in enumerate(flat)).backward()
        grads = [p.grad.cpu() for p in m.parameters() if p.grad is not None] + \
            [x.grad.cpu() for x in xs if x.grad is not None]
        results.append(([o.detach().cpu() for o in flat], grads))
    return results


def _assert_same(results: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
    (cpu_out, cpu_grads), (dev_out, dev_grads) = results
    assert len(cpu_out) == len(dev_out) and len(cpu_grads) == len(dev_grads)
    for a, b in zip(cpu_out + cpu_grads, dev_out + dev_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: (nn.LSTM(4, 5, num_layers=2, batch_first=True), [torch.randn(3, 6, 4)]),
    lambda: (nn.LSTM(4, 5, bidirectional=True, bias=False), [torch.randn(6, 2, 4)]),
    lambda: (nn.LSTM(4, 6, proj_size=3), [torch.randn(5, 2, 4)]),
    lambda: (nn.GRU(4, 5, num_layers=2), [torch.randn(6, 3, 4)]),
    lambda: (nn.GRU(4, 5, bidirectional=True, batch_first=True, bias=False), [torch.randn(2, 6, 4)]),
    lambda: (nn.LSTMCell(4, 5), [torch.randn(3, 4)]),
    lambda: (nn.GRUCell(4, 5), [torch.randn(3, 4)]),
    lambda: (nn.RNN(4, 5, nonlinearity="relu"), [torch.randn(6, 3, 4)]),
], ids=["lstm-2-layers", "lstm-bidirectional-no-bias", "lstm-proj", "gru-2-layers", "gru-bidirectional-no-bias",
        "lstm-cell", "gru-cell", "rnn-relu"])
def test_recurrent_modules_forward_and_backward_match_the_cpu(make):
    torch.manual_seed(0)
    module, inputs = make()
    _assert_same(_run_both(module, inputs))


def test_an_lstm_cell_with_a_given_state_and_only_one_output_used_matches_the_cpu():
    """Only ``cy`` feeds the loss: the backward gets no gradient for ``hy`` (an undefined tensor)."""
    torch.manual_seed(1)
    cell = nn.LSTMCell(3, 4)
    x, h, c = torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 4)
    grads = []
    for device in ("cpu", D0):
        m = copy.deepcopy(cell).to(device)
        _, cy = m(x.to(device), (h.to(device), c.to(device)))
        cy.sum().backward()
        grads.append([p.grad.cpu() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def _draws(device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randint(0, 10, (200,), device=device, generator=g),
        torch.randint(-5, 5, (3, 40), device=device, generator=g, dtype=torch.int32),
        torch.empty(200, device=device).random_(2, 8, generator=g),
        torch.empty(200, dtype=torch.uint8, device=device).random_(generator=g),
        torch.empty(200, dtype=torch.int64, device=device).random_(7, generator=g),
    ]


def test_random_integers_are_in_range_cover_it_and_reproduce_with_a_seeded_generator():
    draws = _draws(D0, 29)
    again = _draws(D0, 29)
    bounds = [(0, 10), (-5, 5), (2, 8), (0, 256), (0, 7)]
    for t, twin, (low, high) in zip(draws, again, bounds, strict=True):
        values = t.cpu()
        assert torch.equal(values, twin.cpu())
        assert int(values.min()) >= low and int(values.max()) < high
        if high - low <= 10:  # 200 draws over at most 10 values: every value appears (chance of a miss < 1e-8)
            assert values.unique().numel() == high - low
    like = torch.randint_like(torch.zeros(50, device=D0), 3, 9).cpu()
    assert like.dtype == torch.float32 and 3 <= float(like.min()) and float(like.max()) < 9
    torch.manual_seed(5)
    first = torch.randint(0, 1000, (20,), device=D0).cpu()
    torch.manual_seed(5)
    assert torch.equal(torch.randint(0, 1000, (20,), device=D0).cpu(), first)


@pytest.mark.cpu_server
def test_random_integers_equal_the_cpu_draws_on_a_cpu_server():
    for remote, local in zip(_draws(D0, 3), _draws("cpu", 3), strict=True):
        assert torch.equal(remote.cpu(), local)


def _scaler_steps(device: str) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.split(":")[0])
    x, y = torch.randn(4, 8).to(device), torch.randn(4, 1).to(device)
    scales = []
    for step in range(3):
        opt.zero_grad()
        with torch.autocast(device.split(":")[0], dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        if step == 1:
            loss = loss * float("inf")  # an overflow: the step is skipped and the scale backs off
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().cpu() for p in model.parameters()], scales


def test_grad_scaler_with_fp16_autocast_steps_and_backs_off_like_the_cpu():
    cpu_params, cpu_scales = _scaler_steps("cpu")
    params, scales = _scaler_steps(D0)
    assert scales == cpu_scales == [65536.0, 32768.0, 32768.0]
    for a, b in zip(cpu_params, params, strict=True):  # fp16 matmuls on both (autocast's lists differ a little)
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)


class _BertLikeEmbeddings(nn.Module):
    """HF BERT's embeddings: token_type_ids default to a registered zeros buffer, expanded (stride 0) per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(30, 8)
        self.token_types = nn.Embedding(2, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("token_type_ids", torch.zeros(1, 12, dtype=torch.long), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        buffer: torch.Tensor = self.token_type_ids  # type: ignore[assignment]
        types = buffer[:, : ids.size(1)].expand(ids.size(0), ids.size(1))
        return self.norm(self.words(ids) + self.token_types(types))


def test_bert_like_embeddings_with_an_expanded_token_type_buffer_train_like_the_cpu():
    torch.manual_seed(3)
    _assert_same(_run_both(_BertLikeEmbeddings(), [torch.randint(0, 30, (3, 10))]))


def test_embedding_with_max_norm_renormalises_the_rows_it_looks_up_like_the_cpu():
    torch.manual_seed(4)
    emb = nn.Embedding(10, 4, max_norm=1.0)
    ids = torch.tensor([[1, 2, 1], [7, 2, 9]])
    _assert_same(_run_both(emb, [ids]))
    weights = []
    for device in ("cpu", D0):
        m = copy.deepcopy(emb).to(device)
        m(ids.to(device))
        weights.append(m.weight.detach().cpu())
    torch.testing.assert_close(weights[1], weights[0])
    assert bool((weights[1][[1, 2, 7, 9]].norm(dim=1) <= 1.0 + 1e-6).all())


def test_round_with_decimals_matches_the_cpu():
    x = torch.randn(50) * 100
    for decimals in (3, 0, -1):
        assert torch.equal(torch.round(x.to(D0), decimals=decimals).cpu(), torch.round(x, decimals=decimals))
    y = x.clone().to(D0)
    y.round_(decimals=2)
    assert torch.equal(y.cpu(), x.round(decimals=2))


def test_cholesky_solve_forward_and_backward_match_the_cpu():
    torch.manual_seed(5)
    a = torch.randn(2, 3, 3)
    factor = torch.linalg.cholesky(a @ a.mT + 3 * torch.eye(3))
    b = torch.randn(2, 3, 2)
    results = []
    for device in ("cpu", D0):
        bb, ff = b.detach().to(device).requires_grad_(), factor.detach().to(device).requires_grad_()
        out = torch.cholesky_solve(bb, ff)
        out.pow(2).sum().backward()
        results.append([out.detach().cpu(), bb.grad.cpu(), ff.grad.cpu()])
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)


def test_rrelu_in_training_draws_slopes_in_range_and_its_backward_uses_them():
    x = torch.randn(400)
    xd = x.detach().to(D0).requires_grad_()
    y = F.rrelu(xd, lower=0.1, upper=0.3, training=True)
    y.sum().backward()
    out, grad = y.detach().cpu(), xd.grad.cpu()
    assert torch.equal(out[x >= 0], x[x >= 0])
    slopes = out[x < 0] / x[x < 0]
    assert bool((slopes >= 0.1 - 1e-6).all()) and bool((slopes <= 0.3 + 1e-6).all()) and slopes.std() > 0.01
    torch.testing.assert_close(grad[x < 0], slopes)
    assert bool((grad[x >= 0] == 1).all())


@pytest.mark.cpu_server
def test_rrelu_in_training_equals_the_cpu_with_a_seeded_generator_on_a_cpu_server():
    x = torch.randn(100)
    outs = []
    for device in ("cpu", D0):
        g = torch.Generator(device=device).manual_seed(11)
        noise = torch.empty(100, device=device)
        outs.append(torch.ops.aten.rrelu_with_noise(x.to(device), noise, 0.1, 0.3, True, g).cpu())
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("dims", [2, 3])
def test_fractional_max_pool_forward_and_backward_match_the_cpu(dims):
    torch.manual_seed(6)
    shape = (2, 3, 8, 8) if dims == 2 else (2, 3, 6, 6, 6)
    samples = torch.rand(2, 3, dims)
    pool = F.fractional_max_pool2d if dims == 2 else F.fractional_max_pool3d
    x = torch.randn(shape)
    results = []
    for device in ("cpu", D0):
        xd = x.detach().to(device).requires_grad_()
        out = pool(xd, 2, output_size=4 if dims == 2 else 3, _random_samples=samples.to(device))
        (out * torch.arange(out.numel(), device=device).reshape(out.shape)).sum().backward()
        results.append([out.detach().cpu(), xd.grad.cpu()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(b, a)
    module = nn.FractionalMaxPool2d(2, output_size=4) if dims == 2 else nn.FractionalMaxPool3d(2, output_size=3)
    xd = x.detach().to(D0).requires_grad_()
    module(xd).sum().backward()  # samples drawn on the device
    assert int(xd.grad.cpu().count_nonzero()) > 0


def test_nonzero_static_pads_or_cuts_like_the_cpu():
    x = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    for size, fill in ((5, -1), (2, 0), (0, -1)):
        expect = torch.nonzero_static(x, size=size, fill_value=fill)
        assert torch.equal(torch.nonzero_static(x.to(D0), size=size, fill_value=fill).cpu(), expect)


def test_median_along_an_expanded_dim_is_computed_not_refused():
    column = torch.tensor([3.0, -1.0, 2.0])
    result = column.to(D0).expand(50, 3).median(0)
    assert torch.equal(result.values.cpu(), column)
    assert torch.equal(column.to(D0).expand(4, 50, 3).nanmedian(1).values.cpu(), column.expand(4, 3))
