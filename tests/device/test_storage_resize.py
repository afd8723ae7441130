"""``UntypedStorage.resize_()`` on remote storages (what FSDP2 frees and regrows its unsharded parameters with),
against the shared server: the storage keeps its id at every size, the server follows in order with the ops,
grown bytes are zero, views see their base's storage, and the memory statistics follow. A regrow the node
refuses: tests/device/test_storage_resize_quota.py."""

from __future__ import annotations

import pytest
import torch

from genie import _C

D0 = "remote_accelerator:0"
D1 = "remote_accelerator:1"

pytestmark = pytest.mark.usefixtures("remote")


def _stats(device: str) -> tuple[int, int]:
    """(bytes allocated, storages allocated) on ``device``."""
    stats = torch.remote_accelerator.memory_stats(device)  # type: ignore[attr-defined]
    return stats["allocated_bytes.all.current"], stats["allocation.all.current"]


def test_resize_to_zero_then_back_keeps_the_id_zero_fills_and_takes_writes() -> None:
    x = torch.arange(8.0, device=D0)
    storage, sid = x.untyped_storage(), _C.storage_id(x)
    storage.resize_(0)
    assert storage.nbytes() == 0 and _C.storage_id(x) == sid
    storage.resize_(32)
    assert _C.storage_id(x) == sid
    assert torch.equal(x.cpu(), torch.zeros(8))  # the server freed the bytes: new ones are zero
    x.copy_(torch.arange(8.0) * 2)
    x.add_(1)
    assert torch.equal(x.cpu(), torch.arange(8.0) * 2 + 1)
    storage.resize_(16)  # a shrink to a part keeps that part
    assert torch.equal(torch.empty(0, device=D0).set_(storage, 0, (4,), (1,)).cpu(), torch.arange(4.0) * 2 + 1)


def test_a_resize_is_ordered_with_the_ops_queued_around_it() -> None:
    x = torch.ones(4, device=D0)
    y = x * 3  # queued before the shrink: it reads the old bytes
    x.untyped_storage().resize_(0)
    x.untyped_storage().resize_(16)
    z = x + 5  # queued after the regrow: it reads zeros
    assert torch.equal(y.cpu(), torch.full((4,), 3.0)) and torch.equal(z.cpu(), torch.full((4,), 5.0))


def test_resizing_a_views_storage_resizes_its_bases() -> None:
    base = torch.arange(16.0, device=D0)
    view = base[4:8]
    view.untyped_storage().resize_(0)
    assert base.untyped_storage().nbytes() == 0
    view.untyped_storage().resize_(64)
    view.fill_(3.0)
    assert torch.equal(base.cpu(), torch.cat([torch.zeros(4), torch.full((4,), 3.0), torch.zeros(8)]))


def test_an_empty_storage_grows_under_a_fresh_id_on_its_own_device() -> None:
    before = {d: _stats(d) for d in (D0, D1)}
    t = torch.empty(0, device=D1)
    assert _C.storage_id(t) == 0
    t.untyped_storage().resize_(16)
    assert _C.storage_id(t) != 0 and t.untyped_storage().device == torch.device(D1)
    t.set_(t.untyped_storage(), 0, (4,), (1,))
    assert torch.equal(t.cpu(), torch.zeros(4))  # made zero-filled on first use
    t.add_(2.0)
    assert torch.equal(t.cpu(), torch.full((4,), 2.0))
    assert _stats(D1) == (before[D1][0] + 16, before[D1][1] + 1) and _stats(D0) == before[D0]


def test_memory_stats_follow_resize_to_zero_and_back() -> None:
    ra = torch.remote_accelerator  # type: ignore[attr-defined]
    start_bytes, start_count = _stats(D0)
    x = torch.empty(1024, device=D0)
    assert _stats(D0) == (start_bytes + 4096, start_count + 1)
    ra.reset_peak_memory_stats(D0)
    x.untyped_storage().resize_(0)
    # the storage is still one (empty) allocation: its id names the server's storage, for a later grow
    assert _stats(D0) == (start_bytes, start_count + 1) and ra.memory_allocated(D0) == start_bytes
    x.untyped_storage().resize_(2 << 20)  # past 1 MiB: from the small pool to the large one
    stats = ra.memory_stats(D0)
    assert ra.memory_allocated(D0) == start_bytes + (2 << 20) and ra.max_memory_allocated(D0) >= start_bytes + (2 << 20)
    assert stats["allocation.all.current"] == start_count + 1 and stats["allocated_bytes.large_pool.current"] >= 2 << 20
    x.untyped_storage().resize_(4096)
    assert _stats(D0) == (start_bytes + 4096, start_count + 1)
    del x
    assert _stats(D0) == (start_bytes, start_count)


def test_a_regrown_storage_never_reads_its_old_host_shadow() -> None:
    x = torch.tensor([1.0, 2.0], device=D0)  # a small upload: the client keeps a shadow of its bytes
    assert x.tolist() == [1.0, 2.0]
    x.untyped_storage().resize_(0)
    x.untyped_storage().resize_(8)  # the old size again, new bytes
    assert x.tolist() == [0.0, 0.0]


def test_a_resize_past_the_largest_storage_is_refused_here_and_changes_nothing() -> None:
    x = torch.ones(2, device=D0)
    with pytest.raises(RuntimeError, match="0 to 2\\*\\*62 bytes"):
        x.untyped_storage().resize_((1 << 62) + 1)
    assert x.untyped_storage().nbytes() == 8 and torch.equal(x.cpu(), torch.ones(2))


def test_tensor_resize_grows_an_empty_storage_in_place_for_every_tensor_over_it() -> None:
    a = torch.empty(0, device=D0)
    b = torch.empty(0, device=D0).set_(a.untyped_storage())
    a.resize_(3).fill_(4.0)
    assert b.untyped_storage().nbytes() == 12  # one storage, as on the CPU
    assert torch.equal(b.set_(b.untyped_storage(), 0, (3,), (1,)).cpu(), torch.full((3,), 4.0))



@pytest.mark.skipif(not hasattr(_C, "register_graph_impl"), reason="this torch has no accelerator graph registry")
def test_a_resize_during_graph_capture_is_refused_and_changes_nothing() -> None:
    from genie.errors import GraphCaptureError

    x = torch.ones(4, device=D0)
    before = _stats(D0)
    graph = torch.accelerator.Graph()
    with pytest.raises(GraphCaptureError, match="a storage resize"), graph:
        x.untyped_storage().resize_(0)  # a captured graph replays ops, not the client's books
    assert x.untyped_storage().nbytes() == 16 and _stats(D0) == before
    assert torch.equal(x.cpu(), torch.ones(4))
