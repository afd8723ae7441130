"""``torch.remote_accelerator``: the device module PyTorch looks up for the backend.

Counts, the current device, synchronisation, random seeds, memory statistics (what this
client's live storages hold; the server's allocator may round up), device properties (the
server's), streams/events (one ordered stream per device), autocast facts and ``amp``: every
attribute of ``torch.cuda`` the device can honour. The other public names of ``torch.cuda``
raise :class:`~genie.errors.UnsupportedFeatureError` saying why.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import attrs
import torch

from genie import _C
from genie.device import registry
from genie.device.dispatch import BACKEND, default_generator
from genie.errors import NotInitializedError, UnsupportedFeatureError

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
    """Wait until every op sent to ``device`` (default: every device) ran; raise deferred errors. Every device
    before ``genie.init()`` (nothing was sent): nothing to wait for, as torch.profiler asks at its exit in any
    process where the device is registered."""
    if device is None:
        if not registry.is_connected():
            return
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
# The figures are genie._C's allocator's (a c10::DeviceAllocator, so torch.accelerator's memory API reads the
# same): the storages this client holds on the device. Nothing is cached here, so reserved equals allocated.
def memory_stats(device: Any = None) -> dict[str, int]:
    """``torch.cuda.memory_stats``' flat dictionary (``allocated_bytes.all.current``, ``.peak``, ...) for the
    storages this client holds on the device, and ``num_storages.current``."""
    stats = _C.memory_stats(_index(device))
    for name in ("oversize_allocations", "oversize_segments"):  # CUDA's blocks past max_split_size: none here
        for kind in ("current", "peak", "allocated", "freed"):
            stats[f"{name}.{kind}"] = 0
    return dict(sorted(stats.items()))


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """:func:`memory_stats` nested at its dots, as ``torch.cuda.memory_stats_as_nested_dict``."""
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def memory_allocated(device: Any = None) -> int:
    """Bytes of the storages this client holds on the device."""
    return int(_C.memory_stats(_index(device))["allocated_bytes.all.current"])


def max_memory_allocated(device: Any = None) -> int:
    """The most :func:`memory_allocated` has been since the start or :func:`reset_peak_memory_stats`."""
    return int(_C.memory_stats(_index(device))["allocated_bytes.all.peak"])


def memory_reserved(device: Any = None) -> int:
    """No client-side caching allocator: what is reserved is what is allocated."""
    return int(_C.memory_stats(_index(device))["reserved_bytes.all.current"])


def max_memory_reserved(device: Any = None) -> int:
    return int(_C.memory_stats(_index(device))["reserved_bytes.all.peak"])


def reset_peak_memory_stats(device: Any = None) -> None:
    _C.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zero the ``allocated``/``freed`` totals and the event counters of :func:`memory_stats`."""
    _C.reset_accumulated_memory_stats(_index(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    """torch.cuda's older name: resets every peak (:func:`reset_peak_memory_stats`)."""
    reset_peak_memory_stats(device)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A short text report of :func:`memory_stats` (current, peak, allocated and freed per statistic)."""
    stats = memory_stats(device)
    lines = [f"remote_accelerator:{_index(device)} memory of this client (storages it holds; nothing cached)"]
    names = ("allocated_bytes", "reserved_bytes", "requested_bytes", "allocation") if abbreviated else (
        "allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "allocation", "segment", "active")
    for name in names:
        figures = ", ".join(f"{kind} {stats[f'{name}.all.{kind}']}" for kind in ("current", "peak", "allocated", "freed"))
        lines.append(f"  {name}: {figures}")
    return "\n".join(lines)


def empty_cache() -> None:
    """Send pending frees now, and give back the host memory large downloads keep for the next one
    (genie/csrc/device/host_pool.cpp: what ``.cpu()`` of 4 MiB or more allocates from).
    ``torch.accelerator.empty_cache()`` calls it too (genie._C's allocator)."""
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
    """The device's one stream: every op of a device runs in order."""
    return torch.Stream(device=torch.device(BACKEND, _index(device)))


default_stream = current_stream


def set_stream(stream: torch.Stream) -> None:
    """Make ``stream``'s device current (each device has one ordered stream, so that is all it changes)."""
    if stream is not None:
        registry.set_current_index(_index(stream.device))


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


class device_of(device):  # noqa: N801
    """Context manager that makes the device of ``obj`` (a tensor) current; a CPU tensor changes nothing."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.get_device() if obj.get_device() >= 0 else None)


class StreamContext(device):
    """``torch.cuda.StreamContext``: the stream's device is current inside (its one ordered stream is the stream)."""

    def __init__(self, stream: torch.Stream | None) -> None:
        super().__init__(None if stream is None else stream.device)
        self.stream = stream


def stream(stream: torch.Stream | None) -> StreamContext:
    """``with torch.remote_accelerator.stream(s):`` as ``torch.cuda.stream``."""
    return StreamContext(stream)


def is_current_stream_capturing() -> bool:
    """Nothing captures on the device's streams (``torch.compile(backend="genie")`` captures graphs instead)."""
    return False


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """Remote devices never read each other's memory: copies between them go through this client."""
    return False


def init() -> None:
    """Nothing to initialise lazily: ``genie.init()`` makes the devices (raises NotInitializedError before it)."""
    if _C.device_count() == 0:
        raise NotInitializedError("no remote_accelerator device yet: call genie.init(master_addr=..., master_port=...) "
                                  "first")


def _make_amp() -> types.ModuleType:
    """``torch.remote_accelerator.amp``, as ``torch.cuda.amp``: autocast, GradScaler, custom_fwd, custom_bwd."""
    amp = types.ModuleType(f"torch.{BACKEND}.amp", "Automatic mixed precision on remote_accelerator (as torch.cuda.amp)")

    class autocast(torch.amp.autocast):  # noqa: N801 - torch.cuda.amp spells it so
        """``torch.autocast("remote_accelerator", ...)`` with torch.cuda.amp.autocast's arguments."""

        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
            super().__init__(BACKEND, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)

    class GradScaler(torch.amp.GradScaler):
        """``torch.amp.GradScaler("remote_accelerator", ...)`` with torch.cuda.amp.GradScaler's arguments."""

        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                     growth_interval: int = 2000, enabled: bool = True) -> None:
            super().__init__(BACKEND, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    for cls in (autocast, GradScaler):
        cls.__module__ = amp.__name__
        cls.__qualname__ = cls.__name__
        setattr(amp, cls.__name__, cls)
    amp.custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=BACKEND)  # type: ignore[attr-defined]
    amp.custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=BACKEND)  # type: ignore[attr-defined]
    return amp


#: torch.cuda attributes the device cannot honour, and why (the rest of torch.cuda's public names get a
#: generic reason; names torch.cuda lacks raise a plain AttributeError).
_WHY_NOT = {
    "mem_get_info": "the server does not report its free memory to clients; memory_allocated() counts this "
                    "client's storages, get_device_properties().total_memory the device's size",
    "get_device_capability": "a remote device has no CUDA compute capability (it may be a CPU); see "
                             "get_device_properties() for what the server reports",
    "set_per_process_memory_fraction": "memory limits are the server's (its per-session quota, docs/server.md)",
    "utilization": "GPU utilisation is a server metric: see `genie status` or the node's /metrics",
    "temperature": "GPU temperature is a server metric: see `genie status` or the node's /metrics",
    "power_draw": "GPU power is a server metric: see `genie status` or the node's /metrics",
    "clock_rate": "GPU clocks are a server metric: see `genie status` or the node's /metrics",
    "CUDAGraph": "CUDA graphs are captured by torch.compile(model, backend=\"genie\"), which replays a graph "
                 "with one message",
    "graph": "CUDA graphs are captured by torch.compile(model, backend=\"genie\")",
    "make_graphed_callables": "CUDA graphs are captured by torch.compile(model, backend=\"genie\")",
}


def _unsupported(name: str) -> UnsupportedFeatureError:
    why = _WHY_NOT.get(name, "it is specific to local CUDA devices (drivers, kernels, allocators, libraries)")
    return UnsupportedFeatureError(f"torch.{BACKEND}.{name} is not supported: {why}")


def _module_getattr(name: str) -> Any:
    if name == "default_generators":
        return tuple(default_generator(i) for i in range(max(_C.device_count(), 1)))
    if not name.startswith("_") and name in _cuda_names():
        raise _unsupported(name)
    raise AttributeError(f"module 'torch.{BACKEND}' has no attribute {name!r}")


@functools.cache
def _cuda_names() -> frozenset[str]:
    return frozenset(n for n in dir(torch.cuda) if not n.startswith("_"))


def make_module() -> types.ModuleType:
    """The module object registered as ``torch.remote_accelerator``: every attribute of ``torch.cuda`` the device
    can honour; the other public names of ``torch.cuda`` raise :class:`~genie.errors.UnsupportedFeatureError`."""
    mod = types.ModuleType(f"torch.{BACKEND}", "genie's remote_accelerator device module")
    for fn in (device_count, synchronize, manual_seed, manual_seed_all, seed, seed_all, initial_seed,
               get_rng_state, set_rng_state, get_rng_state_all, set_rng_state_all, memory_stats, memory_allocated,
               max_memory_allocated, memory_reserved, max_memory_reserved, reset_peak_memory_stats, empty_cache,
               memory_stats_as_nested_dict, reset_accumulated_memory_stats, reset_max_memory_allocated,
               memory_summary, get_device_properties, get_device_name, get_amp_supported_dtype, is_bf16_supported,
               current_stream, set_stream, stream, is_current_stream_capturing,
               can_device_access_peer, init):
        setattr(mod, fn.__name__, fn)
    mod.default_stream = default_stream  # type: ignore[attr-defined]
    mod.memory_cached = memory_reserved  # type: ignore[attr-defined]  # torch.cuda's older names
    mod.max_memory_cached = max_memory_reserved  # type: ignore[attr-defined]
    mod.reset_max_memory_cached = reset_peak_memory_stats  # type: ignore[attr-defined]
    mod.is_available = lambda: _C.device_count() > 0  # type: ignore[attr-defined]
    mod.is_initialized = lambda: _C.device_count() > 0  # type: ignore[attr-defined]
    mod.current_device = registry.current_index  # type: ignore[attr-defined]
    mod.set_device = lambda d: registry.set_current_index(_index(d))  # type: ignore[attr-defined]
    mod._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    mod.device = device  # type: ignore[attr-defined]
    mod.device_of = device_of  # type: ignore[attr-defined]
    mod.StreamContext = StreamContext  # type: ignore[attr-defined]
    mod.Stream = torch.Stream  # type: ignore[attr-defined]
    mod.Event = torch.Event  # type: ignore[attr-defined]
    mod.DeviceProperties = DeviceProperties  # type: ignore[attr-defined]
    mod.OutOfMemoryError = torch.OutOfMemoryError  # type: ignore[attr-defined]
    mod.amp = _make_amp()  # type: ignore[attr-defined]
    mod.__getattr__ = _module_getattr  # type: ignore[method-assign]  # PEP 562: names torch.cuda has
    _C.set_empty_cache_hook(empty_cache)  # torch.accelerator.empty_cache() (genie._C's DeviceAllocator)
    return mod
