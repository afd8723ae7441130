"""The per-session storage store: accounting, quotas, poisoning, freed ids."""

from __future__ import annotations

import pytest
import torch

from genie.errors import ProtocolError, QuotaExceededError, RemoteExecutionError
from genie.server.store import StorageError, StorageStore

CPU = torch.device("cpu")


def _storage(n: int) -> torch.UntypedStorage:
    return torch.zeros(n, dtype=torch.uint8).untyped_storage()


def test_bytes_are_counted_per_storage_and_released_on_free():
    store = StorageStore()
    store.put(1, _storage(1024))
    store.make(2, 16, CPU)
    assert store.bytes_used == 1040 and store.count == 2
    assert store.free([1, 99]) == 1  # an unknown id is ignored
    assert store.bytes_used == 16


def test_storage_quota_names_the_limit():
    store = StorageStore(max_storages=2)
    store.put(1, _storage(1))
    store.put(2, _storage(1))
    with pytest.raises(QuotaExceededError, match="storage limit.*limit 2 .max_session_handles"):
        store.put(3, _storage(1))


def test_byte_quota_is_checked_before_allocating():
    store = StorageStore(max_bytes=100)
    store.put(1, _storage(80))
    with pytest.raises(QuotaExceededError, match="memory limit.*80 bytes in use, 40 more.*limit 100"):
        store.make(2, 40, CPU)
    assert 2 not in store and store.bytes_used == 80


def test_made_storages_are_zero_filled():
    store = StorageStore()
    storage = store.make(1, 4096, CPU)
    assert torch.count_nonzero(torch.empty(0, dtype=torch.uint8).set_(storage)) == 0


def test_poisoned_storage_reports_root_cause_and_counts_towards_the_quota():
    store = StorageStore(max_storages=1)
    store.poison(7, "aten::mm: size mismatch")
    with pytest.raises(RemoteExecutionError, match="storage 7.*earlier command failed: aten::mm: size mismatch"):
        store.get(7)
    with pytest.raises(QuotaExceededError):
        store.put(8, _storage(1))
    assert store.free([7]) == 1


def test_freed_id_is_reported_as_freed_not_remade():
    store = StorageStore()
    store.put(1, _storage(4))
    store.free([1])
    with pytest.raises(StorageError, match="storage 1 was freed"):
        store.get(1)
    with pytest.raises(StorageError, match="was freed"):
        store.make(1, 4, CPU)
    assert store.get(2) is None  # never seen: the executor makes it


def test_reusing_a_live_id_or_id_zero_is_a_protocol_error():
    store = StorageStore()
    store.put(1, _storage(1))
    with pytest.raises(ProtocolError, match="already exists"):
        store.put(1, _storage(1))
    with pytest.raises(ProtocolError, match="from 1 to"):
        store.put(0, _storage(1))


def test_resized_follows_an_in_place_resize():
    store = StorageStore()
    storage = store.make(1, 16, CPU)
    storage.resize_(400)
    store.resized(1)
    assert store.bytes_used == 400 and store.nbytes(1) == 400
    store.free([1])
    assert store.bytes_used == 0


def test_clear_releases_everything_and_reports_what_it_held():
    store = StorageStore()
    store.put(1, _storage(16))
    store.poison(2, "x")
    assert store.clear() == {"storages": 1, "poisoned": 1, "bytes": 16}
    assert store.stats() == {"storages": 0, "poisoned": 0, "bytes": 0}
