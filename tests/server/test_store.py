"""The per-session tensor store: accounting, quotas, poisoning."""

from __future__ import annotations

import pytest
import torch

from genie.errors import ProtocolError, QuotaExceededError, RemoteExecutionError
from genie.server.store import TensorStore, UnknownHandleError


def test_views_share_their_storage_bytes():
    store = TensorStore()
    base = torch.zeros(256)  # 1024 bytes
    store.put(1, base)
    store.put(2, base[10:20])
    store.put(3, base.view(16, 16).t())
    assert store.bytes_used == 1024 and store.stats()["storages"] == 1
    store.free([1, 2])
    assert store.bytes_used == 1024
    store.free([3])
    assert store.bytes_used == 0 and store.handle_count == 0


def test_handle_quota_names_the_limit():
    store = TensorStore(max_handles=2)
    store.put(1, torch.zeros(1))
    store.put(2, torch.zeros(1))
    with pytest.raises(QuotaExceededError, match="handle limit.*limit 2 .max_session_handles"):
        store.put(3, torch.zeros(1))


def test_byte_quota_counts_new_storages_only():
    store = TensorStore(max_bytes=100)
    t = torch.zeros(20)  # 80 bytes
    store.put(1, t)
    store.put(2, t[:5])  # a view: no new bytes
    with pytest.raises(QuotaExceededError, match="memory limit.*80 bytes in use, 40 more.*limit 100"):
        store.put(3, torch.zeros(10))
    assert 3 not in store and store.bytes_used == 80


def test_poisoned_handle_reports_root_cause():
    store = TensorStore()
    store.poison(7, "aten::mm: size mismatch")
    with pytest.raises(RemoteExecutionError, match="handle 7.*earlier op failed: aten::mm: size mismatch"):
        store.get(7)
    assert store.free([7]) == 1
    with pytest.raises(UnknownHandleError, match="handle 7 is unknown"):
        store.get(7)


def test_reusing_a_live_handle_is_a_protocol_error():
    store = TensorStore()
    store.put(1, torch.zeros(1))
    with pytest.raises(ProtocolError, match="already in use"):
        store.put(1, torch.zeros(1))


def test_recount_follows_in_place_resize_and_set():
    store = TensorStore()
    t = torch.zeros(4)
    other = torch.zeros(50)
    store.put(1, t)
    store.put(2, other)
    t.resize_(100)
    store.recount()
    assert store.bytes_used == 600
    t.set_(other)  # now both handles share one storage
    store.recount()
    assert store.bytes_used == 200 and store.stats()["storages"] == 1
    store.free([1])
    assert store.bytes_used == 200
    store.free([2])
    assert store.bytes_used == 0


def test_clear_releases_everything_and_reports_what_it_held():
    store = TensorStore()
    store.put(1, torch.zeros(4))
    store.poison(2, "x")
    assert store.clear() == {"handles": 1, "poisoned": 1, "storages": 1, "bytes": 16}
    assert store.stats() == {"handles": 0, "poisoned": 0, "storages": 0, "bytes": 0}
