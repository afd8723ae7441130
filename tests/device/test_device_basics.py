"""The remote_accelerator device tried as a user would, against a real server process."""

from __future__ import annotations

import copy
import io

import pytest
import torch

D0 = "remote_accelerator:0"
D1 = "remote_accelerator:1"

pytestmark = pytest.mark.usefixtures("remote")


def test_factories_create_remote_tensors_on_the_named_device() -> None:
    for t in (torch.zeros(3, 4, device=D0), torch.ones(2, device=D1), torch.arange(10, device=D0),
              torch.empty(5, device=D0), torch.randn(3, device=D1), torch.tensor([1.0, 2.0], device=D0),
              torch.full((2, 2), 7, device=D0)):
        assert type(t) is torch.Tensor  # an ordinary tensor: no wrapper subclass
        assert t.device.type == "remote_accelerator"
    assert torch.zeros(1, device=D1).device == torch.device(D1)
    assert str(torch.zeros(1, device=D0).device) == D0
    assert torch.tensor([1.0, 2.0], device=D0).cpu().tolist() == [1.0, 2.0]
    assert torch.arange(5, device=D0).tolist() == [0, 1, 2, 3, 4]
    assert torch.full((2, 2), 7, device=D0).sum().item() == 28


def test_to_and_cpu_round_trip_every_cpu_dtype() -> None:
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
              torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
    for dtype in dtypes:
        src = (torch.randn(4, 5) * 10).to(dtype) if not dtype.is_complex else torch.randn(4, 5, dtype=dtype)
        r = src.to(D0)
        assert r.dtype == dtype
        back = r.cpu()
        assert back.device.type == "cpu" and back.dtype == dtype
        assert torch.equal(back, src), dtype


def test_elementwise_reductions_and_matmul_match_cpu() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    ra, rb = a.to(D0), b.to(D0)
    torch.testing.assert_close((ra @ rb).cpu(), a @ b)
    torch.testing.assert_close((ra.sin() * 2 + ra.exp()).cpu(), a.sin() * 2 + a.exp())
    torch.testing.assert_close(ra.sum(dim=1).cpu(), a.sum(dim=1))
    torch.testing.assert_close(ra.mean().cpu(), a.mean())
    torch.testing.assert_close(ra.max(dim=0).values.cpu(), a.max(dim=0).values)
    assert torch.equal(ra.argmax(dim=1).cpu(), a.argmax(dim=1))
    torch.testing.assert_close(torch.softmax(ra, dim=-1).cpu(), torch.softmax(a, dim=-1))
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3)
    torch.testing.assert_close(torch.nn.functional.conv2d(x.to(D0), w.to(D0), padding=1).cpu(),
                               torch.nn.functional.conv2d(x, w, padding=1))


def test_item_tolist_bool_comparisons_and_printing() -> None:
    t = torch.tensor([1.5, -2.0, 3.0], device=D0)
    assert t.sum().item() == pytest.approx(2.5)
    assert t.tolist() == [1.5, -2.0, 3.0]
    assert bool((t > 0).any())
    assert not bool((t > 10).any())
    assert torch.equal((t > 0).cpu(), torch.tensor([True, False, True]))
    text = repr(t)
    assert "remote_accelerator:0" in text and "1.5000" in text
    assert "requires_grad=True" in repr(torch.ones(2, device=D0, requires_grad=True))
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        t.numpy()


def test_indexing_reads_and_assignment() -> None:
    a = torch.arange(24.0).reshape(4, 6)
    r = a.to(D0)
    assert torch.equal(r[1].cpu(), a[1])
    assert torch.equal(r[:, 2:5].cpu(), a[:, 2:5])
    idx = torch.tensor([3, 0])
    assert torch.equal(r[idx.to(D0)].cpu(), a[idx])
    mask = a > 10
    assert torch.equal(r[mask.to(D0)].cpu(), a[mask])
    r[0, 0] = 100.0
    a[0, 0] = 100.0
    r[:, 1] = torch.zeros(4, device=D0)
    a[:, 1] = 0
    r[mask.to(D0)] = -1.0
    a[mask] = -1.0
    assert torch.equal(r.cpu(), a)


def test_views_alias_on_the_server_and_in_place_ops() -> None:
    base = torch.zeros(4, 4, device=D0)
    row = base[1]
    col = base[:, 2]
    row.add_(1.0)
    col.mul_(0).add_(5.0)
    expected = torch.zeros(4, 4)
    expected[1] += 1.0
    expected[:, 2] = 5.0
    assert torch.equal(base.cpu(), expected)
    t = torch.ones(2, 3, device=D0)
    t.t_()
    assert t.shape == (3, 2)
    v = base.view(16)
    v[0] = 42.0
    assert base[0, 0].item() == 42.0
    assert base.transpose(0, 1).contiguous().cpu()[2, 1].item() == 5.0


def test_two_devices_on_one_server_are_distinct_and_mixing_fails_like_cuda() -> None:
    a = torch.ones(3, device=D0)
    b = torch.ones(3, device=D1)
    assert a.device != b.device
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.ones(3)
    assert (a + torch.tensor(2.0)).tolist() == [3.0, 3.0, 3.0]  # 0-dim CPU tensors are allowed
    assert torch.equal(b.to(D0).cpu(), torch.ones(3))


def test_no_grad_deepcopy_and_save_load() -> None:
    t = torch.randn(3, device=D0, requires_grad=True)
    with torch.no_grad():
        u = t * 2
    assert not u.requires_grad
    c = copy.deepcopy(t)
    assert c.device == t.device and c.requires_grad and torch.equal(c.cpu(), t.detach().cpu())
    buf = io.BytesIO()
    torch.save({"t": t.detach()}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["t"]
    assert loaded.device == t.device
    assert torch.equal(loaded.cpu(), t.detach().cpu())


def test_data_dependent_shapes_are_sync_points() -> None:
    a = torch.tensor([0.0, 1.0, 0.0, 2.0, 2.0])
    r = a.to(D0)
    assert torch.equal(r.nonzero().cpu(), a.nonzero())
    assert torch.equal(torch.unique(r).cpu(), torch.unique(a))
    assert torch.equal(r.masked_select(r > 0).cpu(), a.masked_select(a > 0))
