"""The ``remote_accelerator`` PyTorch device: registration, dispatch, op stream.

Importing this package registers the device (see :mod:`genie.device.registration`).
"""

# torch first: its backend autoload (entry point genie.device.registration:autoload) imports the
# registration module; importing that module before torch would find it half-initialised.
import torch  # noqa: F401

from genie.device.registration import ensure_registered
from genie.device.registry import DeviceTable, RemoteDevice

ensure_registered()

BACKEND = "remote_accelerator"

__all__ = ["BACKEND", "DeviceTable", "RemoteDevice", "ensure_registered"]
