"""The ``remote_accelerator`` PyTorch device: registration, RemoteTensor, dispatch, op stream."""

from genie.device.registration import ensure_registered
from genie.device.registry import DeviceTable, RemoteDevice
from genie.device.tensor import BACKEND, RemoteTensor

__all__ = ["BACKEND", "DeviceTable", "RemoteDevice", "RemoteTensor", "ensure_registered"]
