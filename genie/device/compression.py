"""The client's side of compression (genie.wire.compress): the policy, its negotiation after WELCOME, the
link's bandwidth it decides by, and the choice for each transfer.

``compression`` (``GENIE_COMPRESSION``) is ``auto``, ``off`` or ``zstd``:

- ``auto`` compresses uploads and fetches of at least ``compression_min_bytes`` when both ends have
  a codec and the session's link measured below ``compression_below_mbit`` Mbit/s: the bandwidth
  measured earlier for this backend and node (:mod:`genie.transport.measure`'s cache, which
  ``genie discover --master`` fills), else a short measurement over the new session itself
  (:func:`measure_link`: ECHO frames, three small ones for the round trip, then up to
  :data:`PROBE_SAMPLES` of :data:`PROBE_BYTES`, the best rate wins, sampling stops at the first
  sample at or above the threshold). One slow sample (a busy host) never switches compression on.
  Loopback and fast links measure far above the threshold, so nothing is compressed there.
- ``zstd`` compresses every transfer of at least ``compression_min_bytes`` whatever the link; a
  node (or this client) without zstd is an error at connect, never a silent fallback.
- ``off`` never compresses.

A transfer whose first MiB does not compress (random integers, already compressed bytes) is sent as
it is; that is a choice per transfer, not a fallback: the codec stays negotiated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from genie.errors import ConfigError, HandshakeError, ProtocolError
from genie.transport.base import Channel
from genie.wire import compress
from genie.wire import frame as wf

if TYPE_CHECKING:
    from genie.config import ClusterConfig

log = logging.getLogger("genie.device")

MODES = ("auto", "off", "zstd")
#: Links slower than this (Mbit/s) get compression under ``auto``. Measured (benchmarks/bench_compression.py,
#: docs/network.md "Compression"): compress + send beat send by 1.17-1.37x at 10 Mbit/s, broke even at 100
#: (0.99-1.08x) and lost at 1000 (0.18-0.38x: compressing was slower than that link).
DEFAULT_BELOW_MBIT = 100.0
#: Transfers smaller than this are never compressed (a few round-trip-free microseconds are worth more).
DEFAULT_MIN_BYTES = 256 << 10
#: Bytes of the echo a session measures its link with when no figure was measured before.
PROBE_BYTES = 256 << 10
#: At most this many samples of the link's rate per measurement; the best one is the link's.
PROBE_SAMPLES = 3
#: Seconds of echoes after which a measurement stops sampling once it holds two samples (a slow link's
#: measurement stays short; a fast link stops at its first fast sample, far sooner).
PROBE_BUDGET = 0.15
#: Seconds a small first echo (1/16 of the probe) may take before the samples stay that small (a slow link).
SMALL_ECHO_S = 0.02


@attrs.frozen
class CompressionPolicy:
    """What the configuration asks for: ``mode`` (auto, off, zstd), the link threshold, the smallest transfer."""

    mode: str = "auto"
    below_mbit: float = DEFAULT_BELOW_MBIT
    min_bytes: int = DEFAULT_MIN_BYTES
    #: where ``mode`` came from, for errors
    source: str = "default"

    @classmethod
    def from_config(cls, config: ClusterConfig) -> CompressionPolicy:
        """The policy of ``config``'s ``compression``, ``compression_below_mbit`` and ``compression_min_bytes``."""
        return cls(config.compression, config.compression_below_mbit, config.compression_min_bytes,
                   config.sources.get("compression", "default"))


@attrs.frozen
class SessionCompression:
    """What one session compresses: with ``codec`` (None: nothing) from ``min_bytes``; ``reason`` says why."""

    codec: str | None
    min_bytes: int
    reason: str
    #: the link's bandwidth the choice was made by (Mbit/s), when it was measured
    link_mbit: float | None = None

    def wants(self, nbytes: int) -> bool:
        """Whether a transfer of ``nbytes`` goes compressed."""
        return self.codec is not None and nbytes >= self.min_bytes

    def pack(self, src: torch.Tensor, nbytes: int) -> tuple[bytes, compress.Packing] | None:
        """``src``'s bytes (a contiguous CPU tensor of ``nbytes``) compressed, or None: not wanted, or they do
        not compress."""
        if not self.wants(nbytes):
            return None
        return compress.pack(src.detach().reshape(-1).view(torch.uint8), src.element_size())


OFF = SessionCompression(None, 0, "compression is off")


def negotiate(policy: CompressionPolicy, welcome: dict[str, Any], *, channel: Channel, backend: str, address: str,
              where: str) -> SessionCompression:
    """Settle a new session's compression from ``policy`` and WELCOME's ``codecs`` (measuring the link under
    ``auto`` where no figure is cached). ConfigError or HandshakeError when ``zstd`` was asked for and this
    client or the node lacks it."""
    theirs = welcome.get("codecs")
    theirs = [c for c in theirs if isinstance(c, str)] if isinstance(theirs, list) else []
    mine = compress.available_codecs()
    if policy.mode == "off":
        return OFF
    if policy.mode == "zstd":
        if "zstd" not in mine:
            raise ConfigError("compression", "zstd", policy.source,
                              f"auto or off: this client cannot compress with zstd ({compress.missing_hint('zstd')})")
        if "zstd" not in theirs:
            raise HandshakeError(f"{where} cannot decompress zstd (it offers {theirs or 'no codec'}: its genie lacks "
                                 "the zstandard package, or predates compression); install zstandard there, or set "
                                 "GENIE_COMPRESSION=auto (compress where both ends can) or off")
        return SessionCompression("zstd", policy.min_bytes, "asked for (compression=zstd)")
    shared = [c for c in compress.CODECS if c in mine and c in theirs]
    if not shared:
        lacking = "this client" if not mine else where
        return SessionCompression(None, 0, f"no codec both ends have ({lacking} has none)")
    mbit, how = _link_mbit(channel, backend, address, welcome, enough_mbit=policy.below_mbit)
    if mbit is None:
        return SessionCompression(None, 0, "the link could not be measured", None)
    if mbit >= policy.below_mbit:
        return SessionCompression(None, 0, f"the link {how} {mbit:.0f} Mbit/s, at least compression_below_mbit "
                                  f"({policy.below_mbit:g})", mbit)
    log.info("compressing transfers of at least %d bytes to %s with %s: the link %s %.0f Mbit/s", policy.min_bytes,
             where, shared[0], how, mbit)
    return SessionCompression(shared[0], policy.min_bytes, f"the link {how} {mbit:.0f} Mbit/s, below "
                              f"compression_below_mbit ({policy.below_mbit:g})", mbit)


def _link_mbit(channel: Channel, backend: str, address: str, welcome: dict[str, Any], *,
               enough_mbit: float = float("inf")) -> tuple[float | None, str]:
    """The session's bandwidth in Mbit/s, and how it was known: a cached figure, else measured now (sampling stops
    at a sample of ``enough_mbit`` or more)."""
    from genie.transport.measure import cached_figures

    figure = cached_figures(backend, address).get("bandwidth")
    if figure is not None and figure.unit == "Gbit/s":
        return figure.value * 1000, "measured earlier at"
    limits = welcome.get("limits")
    limit = limits.get("max_echo_bytes") if isinstance(limits, dict) else None
    if not isinstance(limit, int) or limit <= 0:
        return None, ""
    return measure_session(channel, min(PROBE_BYTES, limit), enough_mbit=enough_mbit), "measured"


def measure_session(channel: Channel, nbytes: int = PROBE_BYTES, *, enough_mbit: float = float("inf")) -> float:
    """The bandwidth of an open session's link in Mbit/s (:func:`measure_link` over ECHO frames). Only between
    WELCOME and the session's first batch."""
    return measure_link(lambda size: _echo(channel, bytes(size)), nbytes, enough_mbit=enough_mbit)


def measure_link(echo: Callable[[int], float], nbytes: int = PROBE_BYTES, *, enough_mbit: float = float("inf"),
                 samples: int = PROBE_SAMPLES, budget: float = PROBE_BUDGET) -> float:
    """A link's bandwidth in Mbit/s from ``echo(size)``, the seconds an echo of ``size`` bytes each way took.

    The round trip is the best of three small echoes. Then samples: an echo of ``nbytes`` each way, less that
    round trip; the first echo is 1/16 of that, and the samples stay that small while such an echo takes over
    :data:`SMALL_ECHO_S` (a 1 Mbit/s link costs a quarter of a second a sample, not four); a small echo that is
    quicker says the link can afford a full one and is not itself a sample. The best sample is the link's rate: a
    busy host only slows an echo down, so one slow sample never decides. Sampling stops at a sample of
    ``enough_mbit`` or more (a fast link: usually the first), after ``samples`` samples, or once the echoes took
    ``budget`` seconds and two samples are in."""
    rtts = [echo(64) for _ in range(3)]
    rtt, spent = min(rtts), sum(rtts)
    size = max(1, nbytes // 16)
    rates: list[float] = []
    while True:
        took = echo(size)
        spent += took
        took -= rtt
        if size < nbytes and took <= SMALL_ECHO_S:
            size = nbytes  # the link is fast enough for a full echo; a small one's figure is mostly overhead
            continue
        rates.append(float("inf") if took <= 0 else 2 * size * 8 / took / 1e6)
        if max(rates) >= enough_mbit or len(rates) >= samples or (len(rates) >= 2 and spent >= budget):
            return max(rates)


def _echo(channel: Channel, data: bytes) -> float:
    started = time.perf_counter()
    wf.send_frame(channel, wf.MsgKind.ECHO, wf.pack_body({}), [memoryview(data)])
    header, _ = wf.recv_header_and_body(channel, max_payload=len(data))
    if header.kind != wf.MsgKind.ECHO or header.payload_len != len(data):
        raise ProtocolError(f"the node answered a link measurement (ECHO) with {header.kind.name} of "
                            f"{header.payload_len} bytes")
    wf.recv_payload(channel, len(data), [memoryview(bytearray(len(data)))])
    return time.perf_counter() - started
