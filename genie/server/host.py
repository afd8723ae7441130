"""What a node serves, read without importing torch: its devices.

A node's own process only accepts, authenticates and supervises: with process isolation its
session workers (forked from a zygote that imports torch once: :mod:`genie.server.isolation.zygote`)
run every op. So that process needs torch only to ask CUDA about GPUs. A node serving CPU devices
never imports it there: 2.4 s of a core and about 240 MB of memory per node on a 2-core VM
(docs/server.md, "Process isolation, as built"). ``auto`` and ``cuda`` devices ask torch, as before;
sessions in the node's process (``isolation = none``) import it with their first session.

:class:`NodeDevice` is a device of the node (``cpu`` or ``cuda:N``); code that runs ops turns it
into a ``torch.device`` (:func:`torch_devices`).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from genie.errors import ConfigError
from genie.types import GPUInfo

if TYPE_CHECKING:
    import torch


@attrs.frozen
class NodeDevice:
    """One device a node serves: ``type`` ``cpu`` or ``cuda``, ``index`` the GPU (None for the CPU).

    Spelled as ``torch.device`` spells it (``str()`` gives ``cpu`` or ``cuda:0``), with the same
    ``type`` and ``index``, so code that only names devices needs no torch.
    """

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @classmethod
    def of(cls, device: Any) -> NodeDevice:
        """``device`` (a NodeDevice, a ``torch.device`` or its name) as a NodeDevice."""
        if isinstance(device, NodeDevice):
            return device
        kind, _, index = str(device).partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ConfigError("devices", str(device), "argument devices", "'cpu' or 'cuda:N'")
        return cls(kind, int(index) if index else None)


def node_devices(devices: Iterable[Any]) -> list[NodeDevice]:
    """``devices`` (NodeDevices, ``torch.device``s or names) as NodeDevices."""
    return [NodeDevice.of(d) for d in devices]


def torch_devices(devices: Iterable[Any]) -> list[torch.device]:
    """``devices`` as ``torch.device``s: what runs ops (a session's executor) works with these."""
    import torch

    return [torch.device(str(d)) for d in devices]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_devices(spec: str, *, source: str = "argument devices") -> list[NodeDevice]:
    """Turn ``auto``, ``cpu,cpu`` or ``cuda:0,cuda:1`` into the node's device list.

    ``auto`` is every CUDA GPU, or one CPU device when there is none. Repeating
    ``cpu`` gives distinct logical devices (separate indices) on the one CPU.
    Only ``auto`` and ``cuda`` entries import torch (to ask CUDA).
    """
    text = spec.strip().lower()
    if text in ("", "auto"):
        count = _cuda_count()
        return [NodeDevice("cuda", i) for i in range(count)] if count else [NodeDevice("cpu")]
    devices = []
    cuda_seen = 0
    for part in (p.strip() for p in text.split(",")):
        if part == "cpu":
            devices.append(NodeDevice("cpu"))
            continue
        if part == "cuda" or part.startswith("cuda:") and part[5:].isdigit():
            index = int(part[5:]) if ":" in part else cuda_seen
            count = _cuda_count()
            if index >= count:
                raise ConfigError("devices", spec, source, f"cuda indices below {count} (this host has {count} GPUs)")
            devices.append(NodeDevice("cuda", index))
            cuda_seen += 1
            continue
        raise ConfigError("devices", spec, source, "'auto' or a list like 'cpu,cpu' or 'cuda:0,cuda:1'")
    return devices


def cuda_properties(device: NodeDevice) -> Any:
    """torch's properties of the CUDA device ``device`` (name, total_memory, uuid)."""
    import torch

    return torch.cuda.get_device_properties(device.index or 0)


def describe_devices(devices: Iterable[Any]) -> list[dict[str, Any]]:
    """The WELCOME device list: ``{"index", "kind", "name", "memory_total"}`` per logical device."""
    out = []
    for index, device in enumerate(node_devices(devices)):
        if device.type == "cuda":
            props = cuda_properties(device)
            name, memory = props.name, int(props.total_memory)
        else:
            name = platform.processor() or platform.machine() or "cpu"
            memory = host_memory()
        out.append({"index": index, "kind": device.type, "name": name, "memory_total": memory})
    return out


def host_memory() -> int:
    """This host's physical memory in bytes (0 where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def local_gpus(spec: str) -> list[GPUInfo]:
    """The devices a node of ``--devices spec`` serves, as the membership lists them (CPU devices stand in for
    GPUs where there are none)."""
    out = []
    for i, device in enumerate(parse_devices(spec)):
        if device.type == "cuda":
            props = cuda_properties(device)
            out.append(GPUInfo(i, props.name, "cuda", str(getattr(props, "uuid", "")), props.total_memory))
        else:
            out.append(GPUInfo(i, f"cpu{i}", "cpu"))
    return out
