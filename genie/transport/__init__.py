"""Transports: the interface plugins implement, discovery and selection."""

from genie.transport.base import (
    Channel,
    Listener,
    ProbeTarget,
    Transport,
)

__all__ = [
    "Channel",
    "Listener",
    "ProbeTarget",
    "Transport",
]
