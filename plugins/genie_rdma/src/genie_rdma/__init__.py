"""genie-rdma: the ``rdma`` transport (priority 300), with a real verbs probe.

Quick start for plugin authors: when the native binding cannot live in genie's
own environment, probe it out of process. This plugin finds an interpreter that
can import pyverbs (``GENIE_PYVERBS_PYTHON``, this one, or Debian's
``/usr/bin/python3`` with ``python3-pyverbs``), runs a small standalone script
with it and parses one JSON line; see :mod:`genie_rdma.verbs`.

Entry point (``pyproject.toml``)::

    [project.entry-points.genie]
    rdma = "genie_rdma"

Reason codes: ``library_missing`` (no pyverbs: ``apt install python3-pyverbs
rdma-core``), ``no_devices`` (``ibv_get_device_list`` found none, as on any host
without an RDMA NIC or soft-RoCE), ``no_active_ports``, ``ok`` (with devices,
ports and GIDs in ``details``).

The data path runs on NIXL (:mod:`genie_rdma.nixl_path`): tensors are registered
as memory regions and cross by one-sided RDMA READ. Without an RDMA device it runs
over UCX's tcp or shared-memory transports when ``UCX_TLS`` says so (how it is
tested here); verbs and GPUDirect RDMA are hardware-only.
"""

from __future__ import annotations

from genie.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def genie_transports() -> list[type]:
    """The ``rdma`` transport."""
    from genie_rdma.transport import RdmaTransport

    return [RdmaTransport]
