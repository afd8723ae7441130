"""genie-tcp: the TCP transport, and a quick start for transport plugin authors.

TCP is always available: it carries the control plane and is the data plane of
last resort. It is also the smallest complete transport, so it doubles as the
template for new backends.

Writing a transport plugin
==========================

1. Make a distribution ``genie-<x>`` with a top-level package ``genie_<x>`` and
   register it under the ``genie`` entry-point group::

       [project.entry-points.genie]
       x = "genie_x"

2. Subclass :class:`genie.transport.base.Transport`, set ``name`` (unique across
   plugins) and ``default_priority`` (an integer, higher wins: tcp 100, dpdk 200, rdma 300,
   dpdk_gpudev 400, shm 500; define it in your package as ``PRIORITY_<X>``),
   and implement three methods:

   - ``async probe(target) -> ProbeResult``: never raise for "no". Import native
     libraries *here*, lazily; a missing library is
     ``ProbeResult(name, False, "library_missing", reason)``. Figures you measured
     are ``Figure(value, unit, measured=True)``; numbers you merely declare (a
     link speed from a data sheet) are ``measured=False``. Never invent
     measurements.
   - ``connect(host, port, *, timeout) -> Channel`` (blocking).
   - ``listen(host, port) -> Listener`` (blocking; port 0 picks a free port).

3. A :class:`~genie.transport.base.Channel` is a reliable ordered byte stream:
   ``sendv(buffers)`` sends every buffer in order *without joining them* (tensor
   payloads go straight from tensor memory), ``recv_into(view)`` fills a
   caller-owned view exactly (payloads land straight in preallocated tensors),
   ``settimeout(seconds)`` and ``close()``. Translate every backend exception at
   this boundary: a dead peer or a timeout is
   :class:`~genie.errors.ConnectionClosedError` naming the peer, a refused
   connection is :class:`~genie.errors.ConnectError`.

4. Export the classes through the ``genie_transports`` hook::

       from genie import hookimpl

       @hookimpl
       def genie_transports():
           return [XTransport]

``genie plugins`` then lists the plugin, its hooks and its probe result.
"""

from __future__ import annotations

from typing import Any

from genie import hookimpl
from genie_tcp.transport import TcpChannel, TcpListener, TcpTransport

__all__ = ["TcpChannel", "TcpListener", "TcpTransport", "genie_transports"]


@hookimpl
def genie_transports() -> list[Any]:
    """The TCP transport."""
    return [TcpTransport]
