"""The client side of the weight cache: which uploads are named by content key, and asking the node.

A node that keeps a weight cache says so in WELCOME (``cache``: scope, threshold, nonce). An
upload of at least ``min_bytes`` that the policy picks (``upload_cache``: ``params``, the
default, takes parameters and tensors that require grad, which is what ``model.to(device)``
moves; ``all`` takes every upload; ``off`` none) is hashed here and held back. At the next
flush one ``CMD_HAVE`` round trip asks about every held-back upload (at most
:data:`~genie.wire.content.MAX_HAVE_ENTRIES`) with a proof of possession for each; a hit is sent
as a ``cached`` entry (no bytes), a miss as an ordinary upload that also names its key and
possession secret, so the node keeps its bytes for the next session. One round trip for a
whole ``model.to(device)``.

The key and possession secret of the identity scope derive from this user's secret
(:func:`identity_secret`), so a node never hands one client's entries to another, and nobody
else can put other bytes under this user's keys (docs/SECURITY.md).
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Any

import attrs
import torch

from genie.wire import content as wc

log = logging.getLogger("genie.device.transfers")

#: Held-back bytes (the sources stay alive until the flush) that force a flush.
MAX_PENDING_BYTES = 1 << 30
#: Held-back uploads that force a flush (one CMD_HAVE asks about them all).
MAX_PENDING = wc.MAX_HAVE_ENTRIES
#: The file of :func:`identity_secret`, under genie's cache directory.
IDENTITY_FILE = "upload-identity"

_secret: bytes | None = None


def identity_secret(directory: str | os.PathLike[str] | None = None) -> bytes:
    """This user's cache identity: 32 random bytes in ``upload-identity`` under genie's cache directory.

    Made on first use, readable by the owner only. Every process of the user shares it, so a
    new session finds what an earlier one uploaded. When the file cannot be made or is readable
    by others, a secret for this process alone is used (logged): the cache then helps only
    within this process.
    """
    global _secret
    if directory is None and _secret is not None:
        return _secret
    from genie.transport.cache import default_cache_dir

    path = os.path.join(directory if directory is not None else default_cache_dir(), IDENTITY_FILE)
    secret = _read_or_make(path)
    if directory is None:
        _secret = secret
    return secret


def _read_or_make(path: str) -> bytes:
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s is readable by others (mode %o); using a secret for this process only: chmod 600 it",
                        path, stat.S_IMODE(mode))
            return os.urandom(32)
        with open(path, "rb") as f:
            secret = f.read()
        if len(secret) == 32:
            return secret
        log.warning("%s does not hold 32 bytes; using a secret for this process only (delete the file)", path)
    except OSError as exc:
        log.info("no upload identity file (%s); the weight cache helps within this process only", exc)
    return os.urandom(32)


@attrs.define
class Candidate:
    """An upload held back until the node says whether it holds its bytes."""

    storage_id: int
    device: int
    src: torch.Tensor  #: keeps ``view``'s memory alive
    view: memoryview
    key: bytes
    possession: bytes  #: the node keeps it with a miss's bytes; never sent in a HAVE
    proof: bytes  #: :func:`genie.wire.content.possession_proof` for this session


@attrs.define
class ClientCache:
    """One session's view of its node's weight cache, and the uploads waiting for a ``CMD_HAVE``."""

    policy: str
    min_bytes: int
    shared: bool
    nonce: bytes
    secret: bytes
    pending: list[Candidate] = attrs.field(factory=list)
    pending_bytes: int = 0

    @classmethod
    def from_welcome(cls, offer: Any, policy: str) -> ClientCache | None:
        """The cache a WELCOME's ``cache`` entry offers, or None (no cache, policy ``off``, an old node)."""
        if policy == "off" or not isinstance(offer, dict) or offer.get("enabled") is not True:
            return None
        min_bytes, shared, nonce = offer.get("min_bytes"), offer.get("shared") is True, offer.get("nonce", b"")
        if not isinstance(min_bytes, int) or min_bytes < 0 or not isinstance(nonce, bytes) or len(nonce) < 16:
            log.warning("ignoring a malformed weight cache offer: %r", offer)
            return None
        return cls(policy, max(min_bytes, 1), shared, nonce, b"" if shared else identity_secret())

    def wants(self, src: torch.Tensor) -> bool:
        """Whether an upload from ``src`` is named by key (before its bytes are even looked at)."""
        if src.numel() * src.element_size() < self.min_bytes:
            return False
        return self.policy == "all" or isinstance(src, torch.nn.Parameter) or src.requires_grad

    def hold(self, storage_id: int, device: int, src: torch.Tensor, view: memoryview) -> Candidate:
        """Hash ``view`` (no lock held: hashlib releases the GIL) into a candidate for :meth:`add`."""
        fp = wc.fingerprint(view)
        key, possession = wc.shared_claim(fp) if self.shared else wc.identity_claim(self.secret, fp)
        proof = wc.possession_proof(possession, self.nonce, key, view.nbytes)
        return Candidate(storage_id, device, src, view, key, possession, proof)

    def add(self, candidate: Candidate) -> bool:
        """Hold ``candidate`` back; True when enough is held back that the caller should flush."""
        self.pending.append(candidate)
        self.pending_bytes += candidate.view.nbytes
        return self.pending_bytes >= MAX_PENDING_BYTES or len(self.pending) >= MAX_PENDING

    def holds(self, storage_id: int) -> bool:
        """Whether an upload into ``storage_id`` is held back."""
        return any(c.storage_id == storage_id for c in self.pending)

    def take(self) -> list[Candidate]:
        """Every held-back upload, in order; none are held afterwards."""
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        return pending

    @staticmethod
    def question(candidates: list[Candidate]) -> list[list[Any]]:
        """The ``CMD_HAVE`` entries for ``candidates``."""
        return [[c.key, c.view.nbytes, c.proof] for c in candidates]
