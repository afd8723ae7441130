"""The pinned staging pool's logic (genie.server.staging.PinnedPool) on CPU: size classes, reuse, the bound,
buffers in flight, release. Plain host memory stands in for page-locked memory (this machine has no CUDA
driver to pin with); the CUDA copies are hardware-only (scripts/gpu-check)."""

from __future__ import annotations

import pytest
import torch

from genie.server.staging import MIN_CLASS, CudaStaging, PinnedPool, size_class, staging_for


def _host(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_size_classes_are_powers_of_two_from_the_minimum() -> None:
    assert size_class(1) == MIN_CLASS
    assert size_class(MIN_CLASS) == MIN_CLASS
    assert size_class(MIN_CLASS + 1) == 2 * MIN_CLASS
    assert size_class(3 << 20) == 4 << 20
    assert size_class(4 << 20) == 4 << 20


def test_a_returned_buffer_is_reused_for_the_same_class() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    first = pool.take(3 << 20)
    assert first is not None and first.numel() == 4 << 20
    pool.give(first)
    again = pool.take((3 << 20) + 5)  # another size, the same class
    assert again is not None and again.data_ptr() == first.data_ptr()
    assert pool.stats == {"allocated": 1, "reused": 1, "pageable": 0, "released": 0}
    assert pool.bytes == 4 << 20


def test_the_bound_sends_requests_to_the_pageable_path() -> None:
    pool = PinnedPool(8 << 20, max_class=8 << 20, allocate=_host)
    a = pool.take(4 << 20)
    b = pool.take(4 << 20)
    assert a is not None and b is not None
    assert pool.take(1) is None  # 8 MiB in use: nothing more is pinned
    assert pool.take(16 << 20) is None  # over the largest class
    assert pool.stats["pageable"] == 2
    assert pool.bytes == 8 << 20


def test_free_buffers_of_another_class_are_released_to_make_room() -> None:
    pool = PinnedPool(8 << 20, allocate=_host)
    a = pool.take(8 << 20)
    assert a is not None
    pool.give(a)
    small = pool.take(MIN_CLASS)  # the free 8 MiB buffer goes back to the system first
    assert small is not None and small.numel() == MIN_CLASS
    assert pool.stats["released"] == 1
    assert pool.bytes == MIN_CLASS and pool.free_bytes == 0


def test_a_buffer_in_flight_returns_only_once_its_copy_is_done() -> None:
    pool = PinnedPool(64 << 20, allocate=_host)
    buffer = pool.take(1 << 20)
    assert buffer is not None
    done = [False]
    pool.give(buffer, lambda: done[0])
    assert pool.in_flight == 1
    other = pool.take(1 << 20)  # the copy still reads it: a second buffer
    assert other is not None and other.data_ptr() != buffer.data_ptr()
    done[0] = True
    again = pool.take(1 << 20)
    assert again is not None and again.data_ptr() == buffer.data_ptr()
    assert pool.in_flight == 0


def test_in_flight_buffers_count_against_the_bound() -> None:
    pool = PinnedPool(2 << 20, allocate=_host)
    buffer = pool.take(2 << 20)
    assert buffer is not None
    pool.give(buffer, lambda: False)
    assert pool.take(MIN_CLASS) is None  # not released: a copy may still read it
    pool.clear()
    assert pool.bytes == 2 << 20 and pool.in_flight == 1


def test_staging_is_for_cuda_devices_only() -> None:
    assert staging_for(object(), torch.device("cpu")) is None
    with pytest.raises(ValueError, match="CUDA devices"):
        CudaStaging(torch.device("cpu"))
