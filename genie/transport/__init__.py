"""Transports: the interface plugins implement, discovery and selection."""

from genie.transport.base import (
    PRIORITY_DPDK,
    PRIORITY_DPDK_GPUDEV,
    PRIORITY_RDMA,
    PRIORITY_TCP,
    Channel,
    Listener,
    ProbeTarget,
    Transport,
)

__all__ = [
    "PRIORITY_DPDK",
    "PRIORITY_DPDK_GPUDEV",
    "PRIORITY_RDMA",
    "PRIORITY_TCP",
    "Channel",
    "Listener",
    "ProbeTarget",
    "Transport",
]
