"""``torch.remote_accelerator``: the device module PyTorch looks up for the backend.

Counts, the current device, synchronisation, random seeds, memory statistics (what this
client's live storages hold; the server's allocator may round up), device properties (the
server's), streams/events (one ordered stream per device) and autocast facts.
"""

from __future__ import annotations

import types
from typing import Any

import attrs
import torch

from genie import _C
from genie.device import registry
from genie.device.dispatch import BACKEND, default_generator

#: Default generators seeded by manual_seed_all even before init: a cluster rarely has more.
_SEED_AHEAD = 16


def _index(device: Any = None) -> int:
    if device is None:
        return registry.current_index()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return registry.current_index() if d.index is None else d.index


def device_count() -> int:
    """Devices in the cluster this client joined (0 before ``genie.init()``)."""
    return _C.device_count()


def synchronize(device: Any = None) -> None:
    """Wait until every op sent to ``device`` (default: every device) ran; raise deferred errors."""
    if device is None:
        conns = registry.table().connections()
    else:
        conns = [registry.table().get(_index(device)).connection]
    for conn in conns:
        conn.sync()


def _sync_hook(index: int) -> None:
    """Called by the C++ guard (stream/event/device synchronisation)."""
    synchronize(index if index >= 0 else None)


# -- random numbers -------------------------------------------------------------------------------
def manual_seed(seed: int, device: Any = None) -> None:
    """Seed the current (or given) device's default generator; the server's follows before its next random op."""
    default_generator(_index(device)).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(max(_C.device_count(), _SEED_AHEAD)):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator(_index()).seed()


def seed_all() -> None:
    for i in range(max(_C.device_count(), 1)):
        default_generator(i).seed()


def initial_seed() -> int:
    return default_generator(_index()).initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    """A state to restore with :func:`set_rng_state`.

    The generator's stream lives on the server, so taking a state re-seeds the device with a
    fresh seed derived from the current one and returns that seed (8 bytes): restoring it
    replays every draw made after this call. Draws made between the last seed and this call are
    not part of the state.
    """
    g = default_generator(_index(device))
    new_seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(g.initial_seed() + 1)))
    g.manual_seed(new_seed)
    return torch.tensor([new_seed], dtype=torch.int64).view(torch.uint8)


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    seed_value = int(state.view(torch.int64)[0])
    default_generator(_index(device)).manual_seed(seed_value)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    for i, s in enumerate(states):
        set_rng_state(s, i)


# -- memory ---------------------------------------------------------------------------------------
def memory_stats(device: Any = None) -> dict[str, int]:
    """Bytes and storages this client holds on the device (``allocated_bytes.all.current`` / ``.peak``)."""
    return dict(_C.memory_stats(_index(device)))


def memory_allocated(device: Any = None) -> int:
    return int(_C.memory_stats(_index(device))["allocated_bytes.all.current"])


def max_memory_allocated(device: Any = None) -> int:
    return int(_C.memory_stats(_index(device))["allocated_bytes.all.peak"])


def memory_reserved(device: Any = None) -> int:
    """No client-side caching allocator: what is reserved is what is allocated."""
    return memory_allocated(device)


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    _C.reset_peak_memory_stats(_index(device))


def empty_cache() -> None:
    """Send pending frees now, and give back the host memory large downloads keep for the next one
    (genie/csrc/host_pool.cpp: what ``.cpu()`` of 4 MiB or more allocates from)."""
    _C.host_pool_clear()
    try:
        conns = registry.table().connections()
    except Exception:  # before init: nothing to send
        return
    for conn in conns:
        conn.flush()


# -- properties -----------------------------------------------------------------------------------
@attrs.frozen
class DeviceProperties:
    """What the server reports about one of its devices."""

    name: str
    type: str
    total_memory: int
    node_id: str
    local_index: int


def get_device_properties(device: Any = None) -> DeviceProperties:
    d = registry.table().get(_index(device))
    info: dict[str, Any] = {}
    for entry in d.connection.devices:
        if entry.get("index") == d.local_index:
            info = entry
    return DeviceProperties(name=str(info.get("name", d.name)), type=str(info.get("kind", d.kind)),
                            total_memory=int(info.get("memory_total") or 0), node_id=d.node_id,
                            local_index=d.local_index)


def get_device_name(device: Any = None) -> str:
    return get_device_properties(device).name


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def current_stream(device: Any = None) -> torch.Stream:
    return torch.Stream(device=torch.device(BACKEND, _index(device)))


class device:  # noqa: N801 - torch's device modules spell it so
    """Context manager that makes ``device`` current on this thread (like ``torch.cuda.device``)."""

    def __init__(self, device: Any) -> None:
        self.index = -1 if device is None else _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        if self.index >= 0:
            self.previous = _C.current_device()
            _C.set_current_device(self.index)

    def __exit__(self, *exc: Any) -> None:
        if self.previous >= 0:
            _C.set_current_device(self.previous)


def make_module() -> types.ModuleType:
    """The module object registered as ``torch.remote_accelerator``."""
    mod = types.ModuleType(f"torch.{BACKEND}", "genie's remote_accelerator device module")
    for fn in (device_count, synchronize, manual_seed, manual_seed_all, seed, seed_all, initial_seed,
               get_rng_state, set_rng_state, get_rng_state_all, set_rng_state_all, memory_stats, memory_allocated,
               max_memory_allocated, memory_reserved, max_memory_reserved, reset_peak_memory_stats, empty_cache,
               get_device_properties, get_device_name, get_amp_supported_dtype, is_bf16_supported, current_stream):
        setattr(mod, fn.__name__, fn)
    mod.is_available = lambda: _C.device_count() > 0  # type: ignore[attr-defined]
    mod.is_initialized = lambda: _C.device_count() > 0  # type: ignore[attr-defined]
    mod.current_device = registry.current_index  # type: ignore[attr-defined]
    mod.set_device = lambda d: registry.set_current_index(_index(d))  # type: ignore[attr-defined]
    mod._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    mod.device = device  # type: ignore[attr-defined]
    mod.Stream = torch.Stream  # type: ignore[attr-defined]
    mod.Event = torch.Event  # type: ignore[attr-defined]
    mod.DeviceProperties = DeviceProperties  # type: ignore[attr-defined]
    return mod
