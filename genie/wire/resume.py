"""Resuming a data-plane session after its connection dropped: the resume secret, the proofs, the counts.

A client that will reconnect after a drop says so in HELLO (``"resumable": true``); a node that can
resume its session (a session worker: ``isolation = process`` over a plain stream, ``reconnect_window``
above 0) offers it in WELCOME: ``"resume": {"session": id, "window": seconds}``. Any other session
ends when its connection does, as it always did. Both ends then hold a
*resume secret* of that session:

- with a cluster token, ``HMAC-SHA256(token, "genie-resume-v1/secret" | SHA-256(HELLO) | server
  nonce | client nonce)`` (:func:`derive_secret`): each side computes it from the authenticated
  handshake, it never crosses the wire, and nobody who did not take part in that handshake (or
  hold the token and see its nonces) can compute it;
- without a token (a loopback node for one trusted user), 32 random bytes the node sends in the
  offer (``"secret"``): there is nothing to protect them with, as there is nothing protecting the
  session itself.

When the connection drops, the client opens a new one and runs the ordinary handshake (TLS, HELLO,
the token's challenge), its HELLO carrying ``"resume": {"session", "attempt", "mac", "sent",
"await"}``: ``attempt`` counts this client's resume attempts of the session (1, 2, ...), ``mac``
is :func:`resume_proof` over the session id, the attempt and the new HELLO's client nonce, ``sent``
how many BATCH frames the client sent in the session, ``await`` whether it waits for the reply to
the last of them. The node accepts an attempt once (a higher one than any it accepted: a recorded
HELLO replayed is refused), from the identity that opened the session (HELLO's ``node_id`` and
``role``), within the reconnect window after the drop, and hands the new connection to the same
session worker, which answers WELCOME with ``"resumed": {"batches": n}``: the BATCH frames it
received whole (each ran, or runs, exactly once). The client sends again those it sent after the
``n``-th (it keeps every batch until a reply acknowledges it) and, when ``await`` was set and
``n == sent``, the worker sends the reply of the last batch again from its record.

Sequence numbers are the BATCH frames' positions in the session (1, 2, ...), counted by both ends
across connections; no frame carries its number, since a stream delivers them in order and a resume
starts at a count both ends agree on.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from genie.security import NONCE_BYTES, new_nonce

#: Domain separation of the resume secret and of each resume's proof (genie.security's proofs use others).
SECRET_CONTEXT = b"genie-resume-v1/secret"
PROOF_CONTEXT = b"genie-resume-v1/proof"


def derive_secret(token: bytes, hello_bytes: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The resume secret of a session whose handshake was authenticated with ``token``."""
    message = SECRET_CONTEXT + b"|" + hashlib.sha256(hello_bytes).digest() + server_nonce + client_nonce
    return hmac.new(token, message, hashlib.sha256).digest()


def random_secret() -> bytes:
    """The resume secret of a session on a node without a cluster token (sent in WELCOME's offer)."""
    return new_nonce()


def resume_proof(secret: bytes, session_id: int, attempt: int, client_nonce: bytes) -> bytes:
    """``HMAC-SHA256(secret, context | session id | attempt | client nonce of the resuming HELLO)``."""
    message = b"|".join((PROOF_CONTEXT, str(int(session_id)).encode(), str(int(attempt)).encode())) + client_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def proof_ok(secret: bytes, session_id: int, attempt: int, client_nonce: bytes, mac: object) -> bool:
    """Constant-time check of a resume proof (anything but 32 bytes is simply wrong)."""
    return isinstance(mac, bytes) and hmac.compare_digest(resume_proof(secret, session_id, attempt, client_nonce), mac)


def parse_request(value: Any) -> dict[str, Any] | None:
    """HELLO's ``resume`` entry with its types checked, or None when it is malformed (the peer is refused)."""
    if not isinstance(value, dict):
        return None
    session, attempt, mac = value.get("session"), value.get("attempt"), value.get("mac")
    sent, waits = value.get("sent", 0), value.get("await", False)
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < (1 << 62) for v in (session, attempt)):
        return None
    if not isinstance(sent, int) or isinstance(sent, bool) or not 0 <= sent < (1 << 62):
        return None
    if not isinstance(mac, bytes) or len(mac) != NONCE_BYTES or not isinstance(waits, bool):
        return None
    return {"session": session, "attempt": attempt, "mac": mac, "sent": sent, "await": waits}
