"""Content keys of the weight cache, and the proof of possession, for both sides.

An upload of at least ``min_bytes`` may be named by a 32-byte *content key* instead of being
sent (``CMD_HAVE`` asks the node whether it holds those bytes; see :mod:`genie.wire.messages`).
Every entry has a key, which travels in clear, and a 32-byte *possession secret*, which a HAVE
never carries: it proves knowledge of the secret with :func:`possession_proof`, an HMAC under
the secret of a nonce the node sent in this session's WELCOME. A key alone names nothing, and a
proof seen on the wire is worth nothing in another session.

Both come from one pass over the bytes, :func:`fingerprint`: SHA-256 of every 1 MiB chunk, then
two hashes of that digest list under different labels, ``root`` (a public name of the bytes)
and ``secret`` (computable only by whoever holds every byte).

- **identity** (the default): ``possession = HMAC(identity secret, fingerprint secret)`` and
  ``key = SHA-256(possession, root)`` (:func:`identity_claim`). The identity secret never
  leaves the client (:func:`genie.device.transfers.identity_secret`); an upload that names a key
  also carries ``possession`` (with the bytes themselves), and the node keeps the entry only
  when ``key`` is :func:`identity_key` of that possession and the root *it* computes from the
  bytes. So a key is bound to one possession secret and to one content: another identity can
  neither read an entry (no possession) nor put other bytes under its key (no such root).
- **shared** (the node's ``share_cache`` option): ``key = root`` and ``possession = secret``,
  the same for every client; the node computes both from the bytes it receives.

The node checks a proof with the same work whether it holds the key or not (:func:`possession_proof`
under the entry's secret or a dummy one), so a HAVE without a valid proof learns nothing.

SHA-256 rather than BLAKE2b: OpenSSL's SHA-256 uses the CPU's SHA extensions, twice BLAKE2b's
rate on the development machine (0.43 against 0.20 GB/s under load; docs/device.md).
"""

from __future__ import annotations

import hashlib
import hmac

import attrs

#: Length of a content key, a possession secret and a proof.
KEY_BYTES = 32
#: Length of the per-session nonce.
NONCE_BYTES = 32
#: Uploads below this are always sent: a hash and a lookup cost more than the bytes.
DEFAULT_MIN_BYTES = 64 << 10
#: Most entries one ``CMD_HAVE`` may carry (a client asks about at most this many uploads at once).
MAX_HAVE_ENTRIES = 4096
#: The chunks :func:`fingerprint` hashes one by one.
CHUNK_BYTES = 1 << 20

_ROOT = b"genie-content-root\0"
_SECRET = b"genie-content-secret\0"
_IDENTITY_POSSESSION = b"genie-identity-possession\0"
_IDENTITY_KEY = b"genie-identity-key\0"
_PROOF = b"genie-have-proof\0"


@attrs.frozen
class Fingerprint:
    """What one pass over some bytes yields: their public ``root`` and their possession ``secret``."""

    root: bytes
    secret: bytes


def fingerprint(data: memoryview) -> Fingerprint:
    """The :class:`Fingerprint` of ``data`` (hashlib releases the GIL for each chunk)."""
    n = data.nbytes
    digests = b"".join(hashlib.sha256(data[i:i + CHUNK_BYTES]).digest() for i in range(0, n, CHUNK_BYTES))
    length = n.to_bytes(8, "little")
    return Fingerprint(hashlib.sha256(_ROOT + length + digests).digest(),
                       hashlib.sha256(_SECRET + length + digests).digest())


def identity_key(possession: bytes, root: bytes) -> bytes:
    """The identity-scope key of the content ``root`` under the possession secret ``possession``."""
    return hashlib.sha256(_IDENTITY_KEY + possession + root).digest()


def identity_claim(identity: bytes, fp: Fingerprint) -> tuple[bytes, bytes]:
    """``(key, possession)`` of the bytes ``fp`` describes, in the identity scope of the secret ``identity``."""
    possession = hmac.digest(identity, _IDENTITY_POSSESSION + fp.secret, "sha256")
    return identity_key(possession, fp.root), possession


def shared_claim(fp: Fingerprint) -> tuple[bytes, bytes]:
    """``(key, possession)`` of the bytes ``fp`` describes, in the shared scope."""
    return fp.root, fp.secret


def possession_proof(possession: bytes, nonce: bytes, key: bytes, nbytes: int) -> bytes:
    """Proof, for the session of ``nonce``, that the sender knows the possession secret of ``key``."""
    return hmac.digest(possession, _PROOF + nonce + key + nbytes.to_bytes(8, "little"), "sha256")


def checked_possession(*, shared: bool, key: bytes, possession: bytes | None, data: memoryview) -> bytes | None:
    """The possession secret the node keeps for ``data`` named ``key``, or None when ``key`` does not
    name these bytes (shared: their root; identity: :func:`identity_key` of ``possession`` and their root)."""
    fp = fingerprint(data)
    if shared:
        return fp.secret if hmac.compare_digest(fp.root, key) else None
    if not isinstance(possession, bytes) or len(possession) != KEY_BYTES:
        return None
    return possession if hmac.compare_digest(identity_key(possession, fp.root), key) else None
