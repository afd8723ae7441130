"""Content keys of the weight cache, and the proof of possession, for both sides.

An upload of at least ``min_bytes`` may be named by a 32-byte *content key* instead of being
sent (``CMD_HAVE`` asks the node whether it holds those bytes; see :mod:`genie.wire.messages`).
Two scopes:

- **identity** (the default): the key is ``HMAC-SHA256(identity secret, bytes)``. The secret
  never leaves the client (a file of the user's, :func:`genie.device.transfers.identity_secret`),
  so only the holder of the secret can name an entry it uploaded; a client that knows the plain
  hash of someone else's weights names nothing. The node cannot check such a key against the
  bytes, so a client can only mislabel entries in its own scope.
- **shared** (the node's ``share_cache`` option): the key is ``SHA-256(bytes)``, the same for
  every client. The node checks it when it stores the bytes, and a lookup must carry
  :func:`possession_proof`: an HMAC, under a nonce the node sent in this session's WELCOME, of
  :data:`PROOF_BLOCKS` blocks of the bytes at offsets the nonce picks. Knowing the key alone
  is not enough; a client holding only part of the bytes passes with (its share)^64.

SHA-256 rather than BLAKE2b: OpenSSL's SHA-256 uses the CPU's SHA extensions, twice BLAKE2b's
rate on the development machine (0.43 against 0.20 GB/s under load; docs/device.md).
"""

from __future__ import annotations

import hashlib
import hmac

#: Length of a content key and of a proof.
KEY_BYTES = 32
#: Length of the per-session nonce of the shared scope.
NONCE_BYTES = 32
#: Uploads below this are always sent: a hash and a lookup cost more than the bytes.
DEFAULT_MIN_BYTES = 64 << 10
#: Blocks of the bytes a possession proof covers, and their size.
PROOF_BLOCKS = 64
PROOF_BLOCK_BYTES = 4096


def identity_key(secret: bytes, data: memoryview) -> bytes:
    """The key of ``data`` in the identity scope of ``secret``."""
    return hmac.digest(secret, data, "sha256")


def shared_key(data: memoryview) -> bytes:
    """The key of ``data`` in the shared scope (the node checks it)."""
    return hashlib.sha256(data).digest()


def possession_proof(nonce: bytes, key: bytes, data: memoryview) -> bytes:
    """Proof that the sender holds ``data`` (whose key is ``key``) now: blocks chosen by ``nonce``."""
    n = data.nbytes
    blocks = max(1, -(-n // PROOF_BLOCK_BYTES))
    mac = hmac.new(nonce, key, "sha256")
    seed = hmac.digest(nonce, key + n.to_bytes(8, "little"), "sha256")
    for i in range(PROOF_BLOCKS):
        pick = int.from_bytes(hashlib.sha256(seed + i.to_bytes(2, "little")).digest()[:8], "little") % blocks
        mac.update(data[pick * PROOF_BLOCK_BYTES:(pick + 1) * PROOF_BLOCK_BYTES])
    return mac.digest()
