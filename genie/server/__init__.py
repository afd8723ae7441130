"""The node side of the data plane: sessions, the executor of ops, the tensor store and its quotas.

- :mod:`genie.server.node`: :class:`DataPlaneServer` (listen, accept, one thread per session).
- :mod:`genie.server.session`: handshake and the frame loop of one client.
- :mod:`genie.server.executor`: runs a session's uploads, ops, calls, fetches, frees and syncs.
- :mod:`genie.server.store`: handles to tensors, byte and handle quotas, poisoned handles.
- :mod:`genie.server.ops`: op names to OpOverloads, and the deny list.

The protocol itself is described in :mod:`genie.wire.messages` and docs/protocol.md.
"""

from __future__ import annotations

from genie.server.node import DataPlaneServer, describe_devices, parse_devices

__all__ = ["DataPlaneServer", "describe_devices", "parse_devices"]
