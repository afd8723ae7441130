"""The one exception hierarchy of genie.

Every error genie raises on purpose derives from :class:`GenieError`. Backend and
library exceptions (``OSError``, ``ssl.SSLError``, DPDK or verbs failures) are
translated at the boundary where they happen, so callers only ever catch these::

    GenieError
    ├── ConfigError                   an option has a bad value (names option, value, source, what is allowed)
    ├── PluginError                   a plugin failed to load or broke a hook's contract
    │   └── DuplicateTransportError   two plugins claim one transport name (names both)
    ├── NotInitializedError           genie.init() has not run (or shutdown() already did)
    ├── AlreadyInitializedError       genie.init() called twice without shutdown()
    ├── InitTimeoutError              init() ran out of time; names the phase
    ├── TransportError                the network failed
    │   ├── ConnectError              could not reach a peer
    │   ├── BackendUnavailableError   an explicitly requested backend cannot be used (lists every reason)
    │   └── ConnectionClosedError     the peer went away mid-conversation
    ├── ProtocolError                 a peer sent something that breaks the wire rules
    │   ├── HandshakeError            incompatible versions, bad magic, refused hello
    │   ├── FrameError                a malformed, oversized or truncated frame
    │   └── ForbiddenOpError          an op outside aten/prims, or on the deny list
    ├── AuthenticationError           wrong or missing cluster token
    ├── QuotaExceededError            a per-session bound was hit (memory, handles, frame size, ops in flight)
    ├── RemoteExecutionError          an op failed on the server; names the op and its input shapes
    ├── RemoteDeviceLost              the node that held a device died or became unreachable
    └── DeviceError                   misuse of the remote_accelerator device (mixed devices, numpy() ...)
        ├── UnsupportedFeatureError   a torch.cuda feature the device cannot honour (also an AttributeError)
        └── GraphCaptureError         a sync point or host transfer inside torch.accelerator.Graph capture
"""

from __future__ import annotations


class GenieError(Exception):
    """Base of every error genie raises on purpose."""


class ConfigError(GenieError, ValueError):
    """A configuration option has a value genie cannot use.

    The message names the option, the value, where it came from (an argument or
    which environment variable) and what is allowed.
    """

    def __init__(self, option: str, value: object, source: str, allowed: str) -> None:
        self.option = option
        self.value = value
        self.source = source
        self.allowed = allowed
        super().__init__(
            f"invalid value {value!r} for option {option!r} (from {source}); allowed: {allowed}"
        )


class PluginError(GenieError):
    """A plugin failed to load or returned something its hook does not allow."""


class DuplicateTransportError(PluginError):
    """Two plugins claim the same transport name."""


class NotInitializedError(GenieError, RuntimeError):
    """genie is used before ``genie.init()`` or after ``genie.shutdown()``."""


class AlreadyInitializedError(GenieError, RuntimeError):
    """``genie.init()`` was called while genie is already initialised."""


class InitTimeoutError(GenieError, TimeoutError):
    """``genie.init()`` ran past its timeout; ``phase`` names where it was."""

    def __init__(self, phase: str, timeout: float, detail: str = "") -> None:
        self.phase = phase
        self.timeout = timeout
        extra = f": {detail}" if detail else ""
        super().__init__(
            f"genie.init() timed out after {timeout:g} s in phase {phase!r}{extra}; "
            "check that the master is running and reachable, or raise timeout="
        )


class TransportError(GenieError, OSError):
    """The network failed underneath a transport."""


class ConnectError(TransportError):
    """A peer could not be reached."""


class BackendUnavailableError(TransportError):
    """An explicitly requested backend cannot be used; the message lists every candidate's reason."""


class ConnectionClosedError(TransportError):
    """The peer closed the connection or died mid-conversation."""


class ProtocolError(GenieError):
    """A peer sent something that breaks the wire rules."""


class HandshakeError(ProtocolError):
    """The handshake failed: bad magic, incompatible versions or a refused hello."""


class FrameError(ProtocolError):
    """A frame is malformed, oversized or truncated."""


class ForbiddenOpError(ProtocolError):
    """An op is outside ``aten``/``prims`` or on the deny list."""


class AuthenticationError(GenieError):
    """The cluster token is wrong or missing."""


class QuotaExceededError(GenieError):
    """A per-session bound was hit: memory, handles, frame size or ops in flight."""


class RemoteExecutionError(GenieError, RuntimeError):
    """An op failed on the server; the message names the op and its input shapes."""


class RemoteDeviceLost(GenieError, RuntimeError):
    """The node that held a remote device died or became unreachable."""

    def __init__(self, message: str, *, node_id: str = "", device: str = "") -> None:
        self.node_id = node_id
        self.device = device
        super().__init__(message)


class DeviceError(GenieError, RuntimeError):
    """The remote_accelerator device was used in a way it does not support."""


class GraphCaptureError(DeviceError):
    """Something that cannot be captured ran while a ``torch.accelerator.Graph`` was capturing on the device
    (a sync point such as ``.item()`` or ``.cpu()``, a host-to-device copy, a storage resize), as CUDA refuses
    it with "operation not permitted when stream is capturing"; the capture is invalidated."""


class UnsupportedFeatureError(DeviceError, AttributeError):
    """A ``torch.cuda`` attribute that ``torch.remote_accelerator`` cannot honour; the message says why and what
    to use instead. An AttributeError too, so ``hasattr(torch.remote_accelerator, name)`` stays False."""
