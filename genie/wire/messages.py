"""Message bodies of the data plane: HELLO and the torch check; the codes are genie.wire.spec's, the prose docs/protocol.md's."""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from typing import Any

from genie._version import __version__
from genie.wire.frame import PROTOCOL_VERSION
from genie.wire.spec import CMD_CALL as CMD_CALL  # the codes are the spec's (genie.wire.spec)
from genie.wire.spec import CMD_COLLECTIVE as CMD_COLLECTIVE
from genie.wire.spec import CMD_DEVICE_COPY as CMD_DEVICE_COPY
from genie.wire.spec import CMD_DIST_HOST as CMD_DIST_HOST
from genie.wire.spec import CMD_DIST_JOIN as CMD_DIST_JOIN
from genie.wire.spec import CMD_DIST_LEAVE as CMD_DIST_LEAVE
from genie.wire.spec import CMD_DIST_WAIT as CMD_DIST_WAIT
from genie.wire.spec import CMD_FETCH as CMD_FETCH
from genie.wire.spec import CMD_FREE as CMD_FREE
from genie.wire.spec import CMD_GRAPH as CMD_GRAPH
from genie.wire.spec import CMD_HAVE as CMD_HAVE
from genie.wire.spec import CMD_OP as CMD_OP
from genie.wire.spec import CMD_OPTIONS as CMD_OPTIONS
from genie.wire.spec import CMD_PEER_OPEN as CMD_PEER_OPEN
from genie.wire.spec import CMD_PEER_RECV as CMD_PEER_RECV
from genie.wire.spec import CMD_PEER_SEND as CMD_PEER_SEND
from genie.wire.spec import CMD_REPLAY as CMD_REPLAY
from genie.wire.spec import CMD_RESIZE as CMD_RESIZE
from genie.wire.spec import CMD_SEED as CMD_SEED
from genie.wire.spec import CMD_SYNC as CMD_SYNC
from genie.wire.spec import SESSION_OPTIONS as SESSION_OPTIONS


def hello_body(*, node_id: str, role: str, backends: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The first message a connecting peer sends."""
    body = {
        "genie": __version__,
        "protocol": PROTOCOL_VERSION,
        "torch": torch_version(),
        "node_id": node_id,
        "role": role,
        "backends": backends,
    }
    body.update(extra or {})
    return body


@functools.cache
def torch_version() -> str:
    """This process's torch release: ``torch.__version__`` where torch is loaded, otherwise the installed
    distribution's version (the same string, read without importing torch: a CPU node's own process never
    imports it, genie.server.host). Read once: the distribution's metadata costs milliseconds, and a node asks
    on every handshake."""
    loaded = sys.modules.get("torch")
    if loaded is not None and hasattr(loaded, "__version__"):
        return str(loaded.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch not installed as a distribution (a source tree)
        import torch

        return str(torch.__version__)


def torch_compatible(mine: str, theirs: str) -> bool:
    """Peers must run the same torch major.minor: op schemas differ between releases."""
    return mine.split(".")[:2] == str(theirs).split(".")[:2]
