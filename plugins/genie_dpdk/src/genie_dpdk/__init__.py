"""genie-dpdk: the ``dpdk`` transport (priority 200), with a real DPDK probe.

Quick start for plugin authors (this package is also a worked example of a
transport plugin):

1. Declare the entry point in ``pyproject.toml``::

       [project.entry-points.genie]
       dpdk = "genie_dpdk"

2. Implement the hook in the package (keep imports cheap: native libraries are
   loaded inside ``probe()``, never at import)::

       from genie import hookimpl

       @hookimpl
       def genie_transports():
           from genie_dpdk.transport import DpdkTransport
           return [DpdkTransport]

3. The transport class sets ``name`` and ``default_priority``, and its
   ``async probe(target)`` returns a ``ProbeResult`` that says *why* when the
   answer is no (``library_missing``, ``eal_init_failed``, ``no_ports``), never
   raises for "no". Because the answer depends only on this host,
   ``host_fingerprint()`` returns the library paths and mtimes it depends on, and
   discovery caches the result until they change.

What the probe does: it finds ``librte_eal.so.23`` and ``librte_ethdev.so.23``
(DPDK 22.11), starts an EAL in a short-lived subprocess through cffi's ABI mode
(``--no-huge --no-pci --no-shconf``, one virtual ``net_null0`` port, a unique
``--file-prefix``), and reports the port count. See :mod:`genie_dpdk.eal`.

Honest limits: the DPDK *data path* is not implemented in this release.
``connect()`` and ``listen()`` raise ``BackendUnavailableError`` saying so, and the
probe result carries ``details["data_path"] = False``, so selection never picks
``dpdk`` for a connection; ``genie discover`` shows the host's DPDK state.
"""

from __future__ import annotations

from genie.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def genie_transports() -> list[type]:
    """The ``dpdk`` transport."""
    from genie_dpdk.transport import DpdkTransport

    return [DpdkTransport]
