"""Bulk transfers between host and device, against a real server process: where the bytes land."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from genie.wire.buffers import prefault

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


@pytest.mark.skipif(not platform.system() == "Linux" or not _kernel_at_least(5, 14),
                    reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_prefault_populates_fresh_memory_and_keeps_contents() -> None:
    t = torch.empty(64 << 20, dtype=torch.uint8)  # fresh, untouched pages
    before = _rss_bytes()
    prefault(t)
    assert _rss_bytes() - before >= (60 << 20)  # the pages are there before anything writes them
    data = torch.arange(1 << 22, dtype=torch.int32)
    copy = data.clone()
    prefault(data)  # already touched: contents stay as they were
    assert torch.equal(data, copy)
    prefault(torch.empty(0))  # empty and small tensors are left alone
    prefault(torch.empty(10))


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
