"""The ``remote_accelerator`` PyTorch device: registration, dispatch, op stream.

Importing this package registers the device (see :mod:`genie.device.registration`).
"""

# torch first: its device-backend autoload imports genie.device.registration, which would find
# itself half-imported (and fail) were torch first imported from inside it.
import torch  # noqa: F401

from genie.device.registration import ensure_registered
from genie.device.registry import DeviceTable, RemoteDevice

ensure_registered()

BACKEND = "remote_accelerator"

__all__ = ["BACKEND", "DeviceTable", "RemoteDevice", "ensure_registered"]
