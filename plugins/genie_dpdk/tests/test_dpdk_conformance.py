"""The dpdk transport passes the transport conformance suite over memif (both ends in this process).

Real DPDK: one EAL in the test process, a memif server and a memif client port per
channel pair, the shim's polling thread running while channels are open. Needs
Debian's DPDK and the shim built at install (libdpdk-dev); every class skips naming what is missing.
"""

from __future__ import annotations

import pytest
from genie_dpdk import engine
from genie_dpdk.transport import DpdkTransport

from genie.transport.conformance import TransportConformance

requires_shim = pytest.mark.skipif(not engine.shim_built(), reason=engine.NO_SHIM)


@requires_shim
class TestDpdkMemifConformance(TransportConformance):
    """After the handshake: control records on TCP, bulk bytes in DPDK frames over memif."""

    transport_class = DpdkTransport
    bulk_bytes = 4 << 20  # each frame is copied four times on two shared cores: keep the suite quick


@requires_shim
class TestDpdkBeforeHandshakeConformance(TransportConformance):
    """Before the handshake: records on the TCP stream only (no DPDK port opened yet).

    Needs the shim all the same: ``connect`` and ``listen`` refuse without it (BackendUnavailableError naming
    the fix), since a dpdk channel whose data path cannot exist is no channel to hand out.
    """

    transport_class = DpdkTransport
    complete_handshake = False
