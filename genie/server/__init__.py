"""The node side of the data plane: sessions, the executor of ops, the storage store and its quotas.

- :mod:`genie.server.node`: :class:`DataPlaneServer` (listen, accept, one thread per session).
- :mod:`genie.server.host`: the node's devices, read without importing torch.
- :mod:`genie.server.session`: handshake and the frame loop of one client.
- :mod:`genie.server.executor`: runs a session's uploads, ops, calls, fetches, frees, seeds, resizes, syncs.
- :mod:`genie.server.codec`: tensor descriptors (every bound checked), placeholders, result encoding.
- :mod:`genie.server.outputs`: the output rule (in place, adopt, or copy) and CALL results.
- :mod:`genie.server.store`: storages by client id, byte and storage quotas, poisoned storages.
- :mod:`genie.server.rng`: per-session generators (no session shares a random stream).
- :mod:`genie.server.ops`: op names to OpOverloads, the deny list, decompositions for missing kernels.

The protocol itself is described in :mod:`genie.wire.messages` and docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataPlaneServer", "describe_devices", "parse_devices"]


def __getattr__(name: str) -> Any:
    # Lazily: ``python -m genie.server`` starts its session workers' zygote before it imports torch
    # (genie.server.isolation.zygote.start), and importing this package must not import it first.
    if name in __all__:
        from genie.server import host, node

        value = getattr(node if name == "DataPlaneServer" else host, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
