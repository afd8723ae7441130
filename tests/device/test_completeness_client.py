"""Ordinary PyTorch code that CUDA runs works on remote_accelerator too (issue 29, the client's part).

Each case runs the same code on the CPU and on the device of the shared test server and compares.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import genie
from genie.device import registry
from genie.errors import DeviceError, RemoteExecutionError, UnsupportedFeatureError
from genie.wire.frame import MsgKind
from genie.wire.messages import CMD_OPTIONS
from tests.raw_client import RawClient, pack, sync

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


def _ops_sent() -> int:
    """Commands this client queued for device 0's node so far (Python's and genie._C's)."""
    conn = registry.table().get(0).connection
    conn.flush()
    return int(conn.stats["ops"])


def test_numbers_where_a_tensor_goes_match_cpu() -> None:
    # ATen's composites wrap a Python number in a tensor (take_along_dim: remainder(indices, size)); the
    # fallback gets the number back, which remainder.Tensor_out refused.
    x, idx = torch.randn(4, 5), torch.randint(-5, 5, (4, 2))
    for _ in range(4):  # again and again: genie._C must never learn to send the number itself
        assert torch.equal(torch.take_along_dim(x.to(D0), idx.to(D0), dim=1).cpu(),
                           torch.take_along_dim(x, idx, dim=1))
    assert torch.equal(torch.take_along_dim(x.to(D0), idx.abs().to(D0)).cpu(), torch.take_along_dim(x, idx.abs()))
    torch.testing.assert_close(torch.copysign(x.to(D0), -1.5).cpu(), torch.copysign(x, -1.5))
    torch.testing.assert_close(torch.remainder(x.to(D0), 0.75).cpu(), torch.remainder(x, 0.75))
    torch.testing.assert_close(torch.fmod(x.to(D0), 2).cpu(), torch.fmod(x, 2))
    torch.testing.assert_close(torch.where(x.to(D0) > 0, x.to(D0), 0.5).cpu(), torch.where(x > 0, x, 0.5))
    ints = torch.arange(-6, 6, dtype=torch.int32)
    for _ in range(4):
        got = torch.remainder(ints.to(D0), 4)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), torch.remainder(ints, 4))
        assert torch.equal(torch.copysign(ints.to(D0), -2).cpu(), torch.copysign(ints, -2))


def test_item_and_tolist_of_complex_tensors_match_cpu() -> None:
    z = torch.tensor([1.5 - 2j, -0.25 + 4j], dtype=torch.complex64)
    remote = z.to(D0)
    for _ in range(3):  # Python's path and the lane's alike
        assert remote[0].item() == z[0].item() and type(remote[0].item()) is complex
        assert remote.sum().item() == z.sum().item()
    assert remote.tolist() == z.tolist()


def test_linalg_lstsq_returns_the_solution_and_rank_cpu_does() -> None:
    # linalg_lstsq has no meta kernel: a CALL, whose out= results used to come back as new tensors while the
    # (empty) outs torch returns stayed (0,).
    a, b = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    local, remote = torch.linalg.lstsq(a, b), torch.linalg.lstsq(a.to(D0), b.to(D0))
    for name in ("solution", "residuals", "rank", "singular_values"):
        mine, theirs = getattr(remote, name), getattr(local, name)
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype, name
        torch.testing.assert_close(mine.cpu(), theirs, msg=name)
    tall = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    torch.testing.assert_close(torch.linalg.lstsq(tall[0].to(D0), tall[1].to(D0)).solution.cpu(),
                               torch.linalg.lstsq(*tall).solution)


def test_as_strided_partial_views_of_a_device_base_match_cpu() -> None:
    # OpInfo's as_strided partial_views: a view base[5:15] re-strided over its whole storage. The base must be
    # the device's: .to() of a view copies only the view's elements (on CUDA too).
    base = torch.randn(20)
    remote = base.to(D0)
    for offset in (None, 0, 10):
        extra = {} if offset is None else {"storage_offset": offset}
        want = base[5:15].as_strided((2, 2), (1, 2), **extra)
        got = remote[5:15].as_strided((2, 2), (1, 2), **extra)
        assert got.storage_offset() == want.storage_offset()
        assert torch.equal(got.cpu(), want), offset
    partial = remote[5:15].as_strided((2, 2), (1, 2), storage_offset=0)
    partial.mul_(10)
    expected = base.clone()
    expected[5:15].as_strided((2, 2), (1, 2), storage_offset=0).mul_(10)
    assert torch.equal(remote.cpu(), expected)


def test_cpu_masks_and_indices_index_a_device_tensor_as_on_cuda() -> None:
    x = torch.randn(6, 5)
    mask, idx = x[:, 0] > 0, torch.tensor([0, 2, 2, 5])
    remote = x.to(D0)
    assert torch.equal(remote[mask].cpu(), x[mask])
    assert torch.equal(remote[idx].cpu(), x[idx])
    assert torch.equal(remote[idx, torch.tensor([1, 1, 0, 4])].cpu(), x[idx, torch.tensor([1, 1, 0, 4])])
    assert torch.equal(remote[x > 0].cpu(), x[x > 0])  # a CPU mask of the tensor's own shape
    want = x.clone()
    want[mask] = 0
    want[x < -1] = 7.5
    want.index_put_((idx,), torch.ones(5), accumulate=True)
    got = x.to(D0)
    got[mask] = 0
    got[x < -1] = 7.5
    got.index_put_((idx,), torch.ones(5, device=D0), accumulate=True)
    assert torch.equal(got.cpu(), want)
    with pytest.raises(RuntimeError, match="same device"):  # as on CUDA: only indices cross, not values
        x.to(D0).index_select(0, idx)


def test_cpu_scalar_tensors_mix_with_device_tensors_as_on_cuda() -> None:
    x, two = torch.randn(3, 4), torch.tensor(2.0)
    remote = x.to(D0)
    for fn in (lambda t: t + two, lambda t: two * t, lambda t: two - t, lambda t: torch.maximum(two, t),
               lambda t: torch.where(t > 0, t, torch.tensor(0.25)), lambda t: t.lerp(torch.ones_like(t), two / 4)):
        torch.testing.assert_close(fn(remote).cpu(), fn(x))
    assert (two * torch.ones(3, dtype=torch.float16, device=D0)).dtype == torch.float16  # a scalar never promotes


def test_torch_accelerator_memory_api_counts_this_clients_storages() -> None:
    acc = torch.accelerator
    torch.accelerator.empty_cache()  # the DeviceAllocator's emptyCache: sends waiting frees, clears the host pool
    acc.reset_peak_memory_stats(0)
    start = acc.memory_allocated(0)
    big = torch.empty(1 << 18, device=D0)  # 1 MiB: the large pool
    small = torch.empty(100, dtype=torch.uint8, device=D0)
    assert acc.memory_allocated(0) == start + (1 << 20) + 100
    assert acc.max_memory_allocated(0) == start + (1 << 20) + 100
    stats = acc.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == acc.memory_allocated(0)
    assert stats["allocated_bytes.large_pool.current"] >= 1 << 20
    assert stats["reserved_bytes.all.current"] == stats["allocated_bytes.all.current"]  # nothing cached
    assert set(stats) >= {f"{s}.{p}.{k}" for s in ("allocation", "segment", "active", "allocated_bytes",
                                                    "reserved_bytes", "active_bytes", "requested_bytes")
                          for p in ("all", "small_pool", "large_pool") for k in ("current", "peak", "allocated", "freed")}
    del big, small
    assert acc.memory_allocated(0) == start
    assert acc.max_memory_allocated(0) == start + (1 << 20) + 100
    acc.reset_peak_memory_stats(0)
    assert acc.max_memory_allocated(0) == start
    acc.reset_accumulated_memory_stats(0)
    assert acc.memory_stats(0)["allocation.all.allocated"] == 0
    ra = torch.remote_accelerator  # type: ignore[attr-defined]
    assert ra.memory_allocated(D0) == acc.memory_allocated(0)
    assert ra.memory_stats(D0) == {**acc.memory_stats(0), "num_storages.current": ra.memory_stats(D0)["allocation.all.current"]}
    assert ra.memory_stats_as_nested_dict(D0)["allocated_bytes"]["all"]["current"] == start
    assert "allocated_bytes" in ra.memory_summary(D0)
    torch.accelerator.empty_cache()


def test_device_module_offers_cuda_attributes_or_says_why_not() -> None:
    ra = torch.remote_accelerator  # type: ignore[attr-defined]
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with ra.amp.autocast():
        half = a.to(D0) @ b.to(D0)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.cpu().float(), a @ b, atol=0.05, rtol=0.01)
    with ra.amp.autocast(dtype=torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a.to(D0) @ b.to(D0)).dtype == (a @ b).dtype == torch.bfloat16
    scaler = ra.amp.GradScaler(init_scale=128.0)
    assert scaler._device == "remote_accelerator" and scaler.get_scale() == 128.0
    assert ra.device_count() == torch.accelerator.device_count() >= 2 and ra.is_available()
    with ra.device_of(torch.empty(1, device="remote_accelerator:1")):
        assert ra.current_device() == 1
    with ra.stream(ra.current_stream(1)):
        assert torch.empty(1, device="remote_accelerator").device.index == 1
    assert not ra.is_current_stream_capturing() and not ra.can_device_access_peer(0, 1)
    ra.synchronize()
    offered = []
    for name in sorted(n for n in dir(torch.cuda) if not n.startswith("_")):
        if hasattr(ra, name):
            offered.append(name)
            continue
        with pytest.raises(UnsupportedFeatureError, match=f"torch.remote_accelerator.{name} is not supported: "):
            getattr(ra, name)
    assert {"amp", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "memory_stats",
            "empty_cache", "synchronize", "current_device", "set_device", "device_count", "get_device_name",
            "is_available", "manual_seed", "manual_seed_all", "Stream", "Event", "stream", "OutOfMemoryError",
            "default_generators", "get_rng_state", "mem_get_info"} - {"mem_get_info"} <= set(offered)
    with pytest.raises(UnsupportedFeatureError, match="free memory"):
        ra.mem_get_info()
    with pytest.raises(AttributeError):
        ra.no_such_thing  # noqa: B018 - a name torch.cuda lacks: a plain AttributeError


def test_sparse_and_quantized_layouts_fail_at_the_client_naming_the_layout() -> None:
    x = torch.randn(4, 4)
    remote = x.to(D0)
    before = _ops_sent()
    cases = [
        (lambda: remote.to_sparse(), "sparse COO"),
        (lambda: remote.to_sparse_csr(), "sparse CSR"),
        (lambda: x.to_sparse().to(D0), "sparse"),
        (lambda: torch.zeros(3, device=D0, layout=torch.sparse_coo), "sparse"),
        (lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (3,)).to(D0), "sparse"),
        (lambda: torch.quantize_per_tensor(remote, 0.1, 0, torch.quint8), "quantized"),
        (lambda: torch.quantize_per_tensor(x, 0.1, 0, torch.quint8).to(D0), "quantized"),
        (lambda: torch.empty(3, dtype=torch.qint8, device=D0), "quantized"),
    ]
    for make, layout in cases:
        # torch's deprecation warning of quantized factories and its sparse-invariants note
        with warnings.catch_warnings(), pytest.raises(DeviceError) as info:
            warnings.simplefilter("ignore")
            make()
        assert layout in str(info.value) and "not supported on remote_accelerator" in str(info.value)
    assert _ops_sent() == before  # refused before anything was sent
    torch.testing.assert_close((remote * 2).cpu(), x * 2)  # the session is fine


def test_use_deterministic_algorithms_is_honoured_by_the_session() -> None:
    # put_ has no deterministic CPU kernel: torch raises under use_deterministic_algorithms(True) on a CPU,
    # and so must the server's session, also for an op genie._C learned to queue without Python.
    idx, values = torch.tensor([0, 0, 3]), torch.tensor([1.0, 2.0, 3.0])
    ridx, rvalues = idx.to(D0), values.to(D0)

    def put(device: str) -> torch.Tensor:
        i, v = (ridx, rvalues) if device != "cpu" else (idx, values)
        return torch.zeros(5, device=device).put_(i, v)

    for _ in range(3):  # taught to genie._C: the next call is queued natively
        put(D0)
    target = torch.zeros(5, device=D0)
    hits = genie._C.fast_counts()[0]
    target.put_(ridx, rvalues)
    assert genie._C.fast_counts()[0] == hits + 1
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
            put("cpu")
        with pytest.raises(RemoteExecutionError, match="does not have a deterministic implementation"):
            put(D0).cpu()
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning):
            want = put("cpu")
        assert torch.equal(put(D0).cpu(), want)  # warn only: it runs (the warning is the server's)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(put(D0).cpu(), put("cpu"))


@pytest.mark.parametrize("options", [{"deterministic": 1}, {"deterministic": True, "benchmark": True},
                                     {"warn_only": "yes"}, ["deterministic"]])
def test_a_malformed_options_command_is_a_frame_error(genie_serve: Any, options: Any) -> None:
    with RawClient(genie_serve.port) as client:
        client.handshake()
        client.send_batch([pack([CMD_OPTIONS, options])])
        kind, body, _ = client.recv()
        assert kind == MsgKind.ERROR and body["code"] == "frame" and "OPTIONS must be" in body["reason"]
    with RawClient(genie_serve.port) as client:  # a well-formed one: the session runs on
        client.handshake()
        assert client.request([pack([CMD_OPTIONS, {"deterministic": True, "warn_only": True}]),
                               sync(client.next_req())]).error is None


def test_amp_grad_scaler_steps_like_cpus() -> None:
    ra = torch.remote_accelerator  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(8, 4), torch.randn(16, 8), torch.randn(16, 4)

    def train(device: str, scaler: torch.amp.GradScaler, autocast: Any) -> tuple[torch.Tensor, float]:
        m = copy.deepcopy(model).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            with autocast:
                loss = torch.nn.functional.mse_loss(m(x.to(device)), y.to(device))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return m.weight.detach().cpu(), scaler.get_scale()

    remote = train(D0, ra.amp.GradScaler(init_scale=256.0), ra.amp.autocast(enabled=False))
    local = train("cpu", torch.amp.GradScaler("cpu", init_scale=256.0), torch.autocast("cpu", enabled=False))
    torch.testing.assert_close(remote[0], local[0])
    assert remote[1] == local[1] == 256.0
    weight, scale = train(D0, ra.amp.GradScaler(init_scale=256.0), ra.amp.autocast())  # fp16 autocast
    assert scale == 256.0 and bool(torch.isfinite(weight).all())
