"""Bulk transfers between host and device, against a real server process: where the bytes land."""

from __future__ import annotations

import mmap
import os
import platform

import pytest
import torch

from genie.testing import wait_until
from genie.wire.buffers import populated_ahead, prefault, resident

D0 = "remote_accelerator:0"

pytestmark = pytest.mark.usefixtures("remote")


def _cpu_copies(fn: object) -> int:
    """How many ``aten::copy_`` calls torch's profiler records while ``fn()`` runs (nested ones included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()  # type: ignore[operator]
    return sum(1 for e in prof.events() if e.name == "aten::copy_")


def test_download_into_a_preallocated_buffer_receives_in_place_with_no_second_copy() -> None:
    src = torch.randn(256, 1024)
    remote = src.to(D0)
    buf = torch.empty(256, 1024)
    ptr = buf.data_ptr()
    # One copy_: the user's own. A download staged in a temporary tensor shows a second, nested one.
    assert _cpu_copies(lambda: buf.copy_(remote)) == 1
    assert buf.data_ptr() == ptr
    assert torch.equal(buf, src)


def test_downloads_that_cannot_land_in_place_still_convert_and_scatter() -> None:
    src = torch.randn(64, 32)
    remote = src.to(D0)
    strided = torch.zeros(32, 64).t()  # not contiguous: staged, then copied into the strided view
    strided.copy_(remote)
    assert torch.equal(strided, src)
    doubles = torch.zeros(64, 32, dtype=torch.float64)  # another dtype: staged, then converted
    doubles.copy_(remote)
    assert torch.equal(doubles, src.double())
    assert torch.equal(remote.cpu(), src)


def test_large_round_trip_is_exact() -> None:
    src = torch.randn(3 << 20)  # 12 MiB: over the prefault threshold on both ends
    back = src.to(D0).cpu()
    assert torch.equal(back, src)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        parts = platform.release().split(".")
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (ValueError, IndexError):
        return False


def _fresh(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A tensor over pages nobody touched: an anonymous mapping of its own (and the mapping, to keep it alive).
    ``torch.empty`` may hand out resident heap memory: glibc raises its mmap threshold after large frees, so in a
    process that ran other tests a large allocation can come from pages already touched."""
    mapping = mmap.mmap(-1, nbytes)
    return torch.frombuffer(mapping, dtype=torch.uint8), mapping


@pytest.mark.skipif(not platform.system() == "Linux" or not _kernel_at_least(5, 14),
                    reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_prefault_populates_fresh_memory_and_keeps_contents() -> None:
    t, _mapping = _fresh(64 << 20)
    before = _rss_bytes()
    prefault(t)
    assert _rss_bytes() - before >= (60 << 20)  # the pages are there before anything writes them
    data = torch.arange(1 << 22, dtype=torch.int32)
    copy = data.clone()
    prefault(data)  # already touched: contents stay as they were
    assert torch.equal(data, copy)
    prefault(torch.empty(0))  # empty and small tensors are left alone
    prefault(torch.empty(10))


@pytest.mark.skipif(not platform.system() == "Linux" or not _kernel_at_least(5, 14),
                    reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_resident_tells_fresh_memory_from_touched_memory() -> None:
    t, _mapping = _fresh(16 << 20)
    assert not resident(t)
    prefault(t)
    assert resident(t)
    before = _rss_bytes()
    prefault(t)  # resident: left alone (nothing to populate, contents untouched)
    assert _rss_bytes() - before < (1 << 20)
    assert not resident(torch.empty(16))  # small tensors are never advised


@pytest.mark.skipif(not platform.system() == "Linux" or not _kernel_at_least(5, 14),
                    reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_populated_ahead_populates_while_the_body_writes_and_keeps_what_it_wrote() -> None:
    fresh = [torch.empty(48 << 20, dtype=torch.uint8), torch.empty(24 << 20, dtype=torch.uint8)]
    with populated_ahead(*fresh):
        fresh[0][: 8 << 20].fill_(7)  # the body writes as a receive would, racing the helper's population
        # The helper populates both tensors, in order, while the body is still inside the block.
        wait_until(lambda: all(resident(t) for t in fresh), timeout=10, what="the helper populating both tensors")
    assert bool((fresh[0][: 8 << 20] == 7).all())  # what the body wrote stays
    import threading

    with pytest.raises(RuntimeError, match="receive failed"):
        with populated_ahead(torch.empty(64 << 20, dtype=torch.uint8)):
            raise RuntimeError("receive failed")
    assert not any(t.name == "genie-populate" for t in threading.enumerate())  # the helper ends with the block


def test_a_large_download_into_fresh_memory_is_exact() -> None:
    src = torch.randn(12 << 20)  # 48 MiB: the client populates the destination while it receives
    remote = src.to(D0)
    keep = remote.cpu()  # alive: the next .cpu() cannot take a freed block, its memory is fresh
    again = remote.cpu()
    assert torch.equal(keep, src) and torch.equal(again, src)


def test_large_downloads_reuse_freed_host_blocks_and_stay_ordinary_cpu_tensors() -> None:
    """``.cpu()`` of 4 MiB or more takes its memory from genie's host pool (genie/csrc/device/host_pool.cpp): a block
    the last download's tensor freed comes back without a page fault per page. The result is a plain,
    resizable CPU tensor; other ``_to_copy`` forms (dtype change, small, strided) run ATen's own."""
    from genie import _C

    torch.remote_accelerator.empty_cache()  # type: ignore[attr-defined]
    src = torch.randn(2, 1 << 20)  # 8 MiB
    remote = src.to(D0)
    _, _, reused = _C.host_pool_stats()
    first = remote.cpu()
    assert torch.equal(first, src) and first.device.type == "cpu" and first.is_contiguous()
    del first  # its block waits in the pool
    assert _C.host_pool_stats()[:2] == (1, src.numel() * 4)
    second = remote.to("cpu")
    assert torch.equal(second, src) and _C.host_pool_stats()[2] == reused + 1
    second.resize_(3, 1 << 20)  # an ordinary storage: it grows
    second[2] = 1.0
    assert torch.equal(second[:2], src) and bool((second[2] == 1).all())
    del second
    assert torch.equal(remote.to("cpu", torch.float64), src.double())  # a dtype change: ATen's composite
    assert torch.equal(remote.t().cpu(), src.t())  # strided: preserve_format keeps its strides, as on CUDA
    assert remote.t().cpu().stride() == src.t().stride()
    assert torch.equal(remote[:, :10].cpu(), src[:, :10])  # small: the default allocator
    torch.remote_accelerator.empty_cache()  # type: ignore[attr-defined]
    assert _C.host_pool_stats()[:2] == (0, 0)


# Larger than genie.server.staging.CHUNKED_FROM (64 MiB): on a CUDA server (scripts/gpu-check, hardware-only) these go
# through pinned staging in 16 MiB chunks, the copies overlapping the socket; on a CPU server, the plain path.

def test_a_transfer_larger_than_the_chunking_size_round_trips_exactly() -> None:
    src = torch.randn(17 << 20)  # 68 MiB of float32: 4 whole chunks and a short one
    remote = src.to(D0)
    assert torch.equal(remote.cpu(), src)
    buf = torch.empty_like(src)
    buf.copy_(remote)  # received straight into the caller's buffer, in parts from a CUDA server
    assert torch.equal(buf, src)
    assert torch.equal(remote[-5:].cpu(), src[-5:])  # the last (short) chunk's bytes landed where they belong


def test_a_large_upload_overwrites_an_existing_storage_in_place_and_orders_after_earlier_work() -> None:
    first = torch.randn(4, 9 << 20)  # 144 MiB
    remote = first.to(D0)
    summed = remote.sum(dim=0)  # queued before the overwrite: it must see the old bytes
    second = torch.randn(4, 9 << 20)
    remote.copy_(second)  # a whole-storage upload into the existing storage (on CUDA: chunk by chunk, in place)
    assert torch.allclose(summed.cpu(), first.sum(dim=0))
    assert torch.equal(remote.cpu(), second)
    assert torch.equal((remote * 2)[3, -3:].cpu(), second[3, -3:] * 2)  # later work sees every chunk


def test_a_large_strided_download_is_made_contiguous_then_sent_in_parts() -> None:
    src = torch.randn(3 << 10, 6 << 10)  # 72 MiB
    remote = src.to(D0)
    assert torch.equal(remote.t().contiguous().cpu(), src.t().contiguous())
    assert torch.equal(remote.t().cpu(), src.t())


@pytest.mark.parametrize(("dtype", "value", "expected"), [
    (torch.float32, torch.tensor(2.5), [2.5, 2.5, 2.5]),
    (torch.int32, torch.tensor(2.7), [2, 2, 2]),  # copy_'s conversion: truncation
    (torch.float16, torch.tensor(1e10, dtype=torch.float64), [float("inf")] * 3),  # overflow: inf, not an error
    (torch.bool, torch.tensor(0.5), [True, True, True]),
    (torch.int64, torch.tensor(2**40), [2**40] * 3),
])
def test_a_host_scalar_copied_into_a_device_tensor_is_sent_as_a_fill_of_the_converted_value(
        python_ops: list[str], dtype: torch.dtype, value: torch.Tensor, expected: list[object]) -> None:
    """ATen's copy_ of host memory into a CUDA tensor synchronizes the device's stream; its fill_ from a host scalar
    passes the value to the kernel. So a 0-dim host source is converted to the destination's dtype on the client
    (copy_'s conversion, so overflow is inf as copy_ gives) and sent as ``fill_.Tensor``."""
    dst = torch.zeros(3, dtype=dtype, device=D0)
    python_ops.clear()
    dst[1:].copy_(value)
    dst[0].copy_(value)
    assert python_ops == ["aten::fill_.Tensor", "aten::fill_.Tensor"]
    assert dst.cpu().tolist() == expected
