"""Which cluster device ``remote_accelerator:N`` is: node, local index, connection.

``genie.init()`` fills the table in the master's stable order; ``shutdown()``
empties it. Looking up a device before init raises NotInitializedError. The
table grows when a node joins after init (:meth:`DeviceTable.append`, at the end:
existing indices never change); code that caches per-device state subscribes
with :func:`on_devices_added`. The C++ device count (genie._C, what the device
guard and ``torch.accelerator`` report) follows the current table whenever it is
set or grows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import attrs

from genie import _C
from genie.device.connection import NodeConnection, device_label
from genie.errors import DeviceError, NotInitializedError
from genie.wire import messages as wm


@attrs.frozen
class RemoteDevice:
    """One GPU of the cluster as this client sees it."""

    index: int
    node_id: str
    local_index: int
    kind: str
    name: str
    connection: NodeConnection = attrs.field(eq=False, repr=False)

    @property
    def label(self) -> str:
        return device_label(self.index)


class DeviceTable:
    """The cluster's devices by global index."""

    def __init__(self, devices: list[RemoteDevice]) -> None:
        self.devices = devices
        self._grow = threading.Lock()

    def append(self, devices: list[RemoteDevice]) -> None:
        """Add devices at the end (each ``index`` must be the next one); tells every listener."""
        with self._grow:
            for d in devices:
                if d.index != len(self.devices):
                    raise DeviceError(f"{d.label} cannot be appended as index {len(self.devices)}: the cluster "
                                      "order only grows at its end")
                self.devices.append(d)
            if _table is self:
                _C.set_device_count(len(self.devices))
                _route(self)
        for listener in list(_listeners):
            listener(devices)

    def __len__(self) -> int:
        return len(self.devices)

    def get(self, index: int | None) -> RemoteDevice:
        idx = current_index() if index is None else index
        if not 0 <= idx < len(self.devices):
            raise DeviceError(
                f"remote_accelerator:{idx} does not exist: the cluster has {len(self.devices)} device(s) "
                f"(remote_accelerator:0..{len(self.devices) - 1})"
            )
        return self.devices[idx]

    def connections(self) -> list[NodeConnection]:
        seen: dict[int, NodeConnection] = {}
        for d in self.devices:
            seen.setdefault(id(d.connection), d.connection)
        return list(seen.values())


_table: DeviceTable | None = None
_listeners: list[Callable[[list[RemoteDevice]], None]] = []


def on_devices_added(listener: Callable[[list[RemoteDevice]], None]) -> Callable[[], None]:
    """Call ``listener(new_devices)`` whenever the table grows (on the thread that grew it).

    Returns a function that removes the listener.
    """
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def _route(table: DeviceTable | None) -> None:
    """Tell genie._C's op path which session queue and node index each device has (none: no table)."""
    routes = [(d.connection.qid, d.local_index) for d in table.devices] if table is not None else []
    _C.set_routes(routes, wm.CMD_OP, wm.CMD_CALL)
    _C.set_sdp_kinds([_sdp_kind(d.kind) for d in table.devices] if table is not None else [])  # SDPA's kernel (sdpa.cpp)


def _sdp_kind(kind: str) -> str:
    """The server kind sdpa.cpp chooses attention's kernel for.

    A CUDA server's fused path (ATen's ``overrideable`` op, sent whole: registration's WHOLE_OPS) is opt-in
    (``GENIE_SDPA_CUDA_FUSED=1``). On the second GPU check (H200, torch 2.11, 2026-11-27) the client sent it
    and the server's memory-efficient kernel matched the CPU in float32, but the flash kernel's float16 results
    did not (tests/device/test_sdpa.py, cause not found yet). Without the opt-in a CUDA server gets the math
    path (correct, a dozen ops instead of one).
    """
    if kind == "cuda" and os.environ.get("GENIE_SDPA_CUDA_FUSED") != "1":
        return "cuda-math"
    return kind


def set_table(table: DeviceTable | None) -> None:
    global _table
    _table = table
    _C.fast_forget()  # another cluster's servers may answer some signatures differently (KIND_FIXUPS)
    _route(table)
    _C.set_device_count(len(table) if table is not None else 0)
    _C.new_session()
    _C.set_default_device(0)


def device_at(index: int) -> RemoteDevice:
    """``table().get(index)`` for the per-op paths: one list lookup, the full check only on a miss."""
    tbl = _table
    return tbl.devices[index] if tbl is not None and 0 <= index < len(tbl.devices) else table().get(index)


def is_connected() -> bool:
    """Whether genie.init() gave this process its device table (False before it and after shutdown)."""
    return _table is not None


def table() -> DeviceTable:
    """The device table; NotInitializedError before ``genie.init()``."""
    if _table is None:
        raise NotInitializedError(
            "remote_accelerator is not connected: call `await genie.init(master_addr=...)` "
            "(or genie.init_sync(...)) before using the device"
        )
    return _table


def current_index() -> int:
    """This thread's current device: its own once it called ``set_device`` (or a device guard set
    one), else the process default (see :func:`set_default_index`; ``genie.init`` chooses it by
    placement). ``torch.accelerator.current_device_index()`` reports the same."""
    return _C.current_device()


def set_default_index(index: int) -> None:
    """The current device of threads that never chose one (``remote_accelerator`` with no index)."""
    if _table is not None:
        _table.get(index)
    _C.set_default_device(index)


def set_current_index(index: int) -> None:
    table().get(index)
    _C.set_current_device(index)
