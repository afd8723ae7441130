"""Which cluster device ``remote_accelerator:N`` is: node, local index, connection.

``genie.init()`` fills the table in the master's stable order; ``shutdown()``
empties it. Looking up a device before init raises NotInitializedError. The C++
device count (genie._C, what the device guard and ``torch.accelerator`` report)
follows the current table whenever it is set or grows.
"""

from __future__ import annotations

import attrs

from genie import _C
from genie.device.connection import NodeConnection
from genie.errors import DeviceError, NotInitializedError


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
        return f"remote_accelerator:{self.index}"


class DeviceTable:
    """The cluster's devices by global index."""

    def __init__(self, devices: list[RemoteDevice]) -> None:
        self.devices = devices

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

    def add(self, device: RemoteDevice) -> None:
        """Append a device that joined late (its index must be the next one)."""
        if device.index != len(self.devices):
            raise DeviceError(f"device index {device.index} does not follow the table's {len(self.devices)} devices")
        self.devices.append(device)
        if _table is self:
            _C.set_device_count(len(self.devices))

    def connections(self) -> list[NodeConnection]:
        seen: dict[int, NodeConnection] = {}
        for d in self.devices:
            seen.setdefault(id(d.connection), d.connection)
        return list(seen.values())


_table: DeviceTable | None = None


def set_table(table: DeviceTable | None) -> None:
    global _table
    _table = table
    _C.set_device_count(len(table) if table is not None else 0)


def table() -> DeviceTable:
    """The device table; NotInitializedError before ``genie.init()``."""
    if _table is None:
        raise NotInitializedError(
            "remote_accelerator is not connected: call `await genie.init(master_addr=...)` "
            "(or genie.init_sync(...)) before using the device"
        )
    return _table


def current_index() -> int:
    """This thread's current remote device (``torch.accelerator.current_device_index()`` too)."""
    return _C.current_device()


def set_current_index(index: int) -> None:
    table().get(index)
    _C.set_current_device(index)
