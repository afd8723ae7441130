"""Cluster security: the shared token, HMAC challenge-response proofs, TLS contexts, rate-limited refusals.

The cluster token comes from ``auth_token`` (``GENIE_AUTH_TOKEN``) or from the
file ``auth_token_file`` (``GENIE_AUTH_TOKEN_FILE``), which must not be
readable by other users. It never crosses the wire: each side proves it knows
the token with ``HMAC-SHA256(token, context || role || SHA-256(HELLO) ||
server nonce || client nonce)`` over fresh random nonces (see
:mod:`genie.wire.handshake` and docs/protocol.md), and proofs are compared in
constant time.

TLS is optional and independent of the token: a node with ``tls_cert``
(``GENIE_TLS_CERT``, key in ``tls_key``) serves TLS on both planes; a peer with
``tls_ca`` (or a ``tls_cert`` of its own) connects with TLS and checks the
server's certificate against ``tls_ca``. ``tls_require_client_cert`` makes
servers demand a client certificate signed by ``tls_ca`` (mutual TLS).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import ssl
import stat
import threading
import time
from typing import Any, TypeGuard

import attrs

from genie.config import ClusterConfig
from genie.errors import ConfigError

log = logging.getLogger("genie.security")

#: Random bytes each side contributes to a handshake.
NONCE_BYTES = 32
#: The only MAC algorithm spoken (named in HELLO so a later one can be negotiated).
MAC_ALG = "hmac-sha256"
#: Domain separation: a proof made for one plane or one side is useless on the other.
CONTEXT_DATA = b"genie-auth-v1/data"
CONTEXT_CONTROL = b"genie-auth-v1/control"
CLIENT, SERVER = b"client", b"server"

#: What a refused peer is told, and what the client's AuthenticationError says.
AUTH_HINT = ("wrong or missing cluster token; set GENIE_AUTH_TOKEN (or GENIE_AUTH_TOKEN_FILE) to the "
             "cluster's token on every node and client")
TLS_HINT = ("this node requires TLS; set GENIE_TLS_CA to the CA that signed its certificate "
            "(and GENIE_TLS_CERT/GENIE_TLS_KEY if it demands client certificates)")


# -- the token ------------------------------------------------------------------------------------

def read_token_file(path: str, source: str = "argument auth_token_file") -> bytes:
    """The token in ``path`` (surrounding whitespace stripped); refuses a file other users may read."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            token = f.read(1 << 16).strip()
    except OSError as exc:
        raise ConfigError("auth_token_file", path, source, f"a readable file ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError("auth_token_file", path, source, "a regular file")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError("auth_token_file", path, source,
                          f"a file other users cannot read or write (it is mode {stat.S_IMODE(st.st_mode):o}; "
                          f"run chmod 600 {path})")
    if st.st_mode & (stat.S_IRGRP | stat.S_IWGRP):
        log.warning("cluster token file %s is readable by its group (mode %o); chmod 600 it",
                    path, stat.S_IMODE(st.st_mode))
    if not token:
        raise ConfigError("auth_token_file", path, source, "a file holding a non-empty token")
    return token


def load_token(config: ClusterConfig) -> bytes:
    """The cluster token as bytes (``auth_token`` wins over ``auth_token_file``); empty when none is set."""
    if config.auth_token:
        return config.auth_token.encode()
    if config.auth_token_file:
        return read_token_file(config.auth_token_file,
                               config.sources.get("auth_token_file", "argument auth_token_file"))
    return b""


# -- HMAC challenge-response ------------------------------------------------------------------------

def new_nonce() -> bytes:
    """Fresh random bytes for one handshake."""
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, context: bytes, side: bytes, transcript: bytes, server_nonce: bytes,
          client_nonce: bytes) -> bytes:
    """``HMAC-SHA256(token, context | side | SHA-256(transcript) | server nonce | client nonce)``."""
    message = b"|".join((context, side, hashlib.sha256(transcript).digest())) + server_nonce + client_nonce
    return hmac.new(token, message, hashlib.sha256).digest()


def proof_matches(expected: bytes, got: object) -> bool:
    """Constant-time comparison of a received proof (anything but 32 bytes is simply wrong)."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)


def valid_nonce(value: object) -> TypeGuard[bytes]:
    """True for a nonce of the right type and length."""
    return isinstance(value, bytes) and len(value) == NONCE_BYTES


# -- refusals, logged without flooding ------------------------------------------------------------------

class RefusalLog:
    """At most ``burst`` warnings per ``interval`` seconds; the rest are counted and summarised.

    A flood of bad handshakes must not become a flood of log lines (disk, and the
    operator's attention): the first few are logged with their reason, then one
    line per interval says how many more were refused.
    """

    def __init__(self, logger: logging.Logger, *, burst: int = 5, interval: float = 10.0,
                 what: str = "refused connections") -> None:
        self.logger = logger
        self.what = what  #: what the summary line counts
        self.burst = burst
        self.interval = interval
        self.total = 0
        self._lock = threading.Lock()
        self._window_start = -1e18
        self._in_window = 0
        self._suppressed = 0

    def reset(self) -> None:
        """Start a fresh window (tests, or after the operator has looked)."""
        with self._lock:
            self._window_start, self._in_window, self._suppressed = -1e18, 0, 0

    def warning(self, msg: str, *args: Any) -> None:
        """Log one refusal, unless this window's budget is spent."""
        now = time.monotonic()
        with self._lock:
            self.total += 1
            summary = 0
            if now - self._window_start >= self.interval:
                summary, self._suppressed = self._suppressed, 0
                self._window_start, self._in_window = now, 0
            emit = self._in_window < self.burst
            if emit:
                self._in_window += 1
            else:
                self._suppressed += 1
        if summary:
            self.logger.warning("%d more %s were not logged in the last %g s", summary, self.what,
                                self.interval)
        if emit:
            self.logger.warning(msg, *args)


#: Shared by both planes of this process.
REFUSALS = RefusalLog(log)


# -- TLS --------------------------------------------------------------------------------------------

def _source(config: ClusterConfig, option: str) -> str:
    return config.sources.get(option, f"argument {option}")


def _tls_files_error(config: ClusterConfig, option: str, exc: BaseException) -> ConfigError:
    return ConfigError(option, getattr(config, option), _source(config, option),
                       f"a readable PEM file ({type(exc).__name__}: {exc})")


@functools.lru_cache(maxsize=8)
def _server_context(cert: str, key: str, ca: str, require_client: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key or None)
    if require_client:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=ca)
    return ctx


@functools.lru_cache(maxsize=8)
def _client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        ctx.load_cert_chain(cert, key or None)
    return ctx


def server_tls_context(config: ClusterConfig) -> ssl.SSLContext | None:
    """The context a node serves TLS with (None when ``tls_cert`` is unset); ConfigError for bad files."""
    if not config.tls_cert:
        if config.tls_require_client_cert:
            raise ConfigError("tls_require_client_cert", True, _source(config, "tls_require_client_cert"),
                              "false unless tls_cert (GENIE_TLS_CERT) is set too")
        return None
    if config.tls_require_client_cert and not config.tls_ca:
        raise ConfigError("tls_ca", "", _source(config, "tls_ca"),
                          "the CA that signs client certificates, required by tls_require_client_cert")
    try:
        return _server_context(config.tls_cert, config.tls_key, config.tls_ca, config.tls_require_client_cert)
    except (OSError, ssl.SSLError, ValueError) as exc:
        option = "tls_ca" if "verify" in str(exc).lower() else "tls_cert"
        raise _tls_files_error(config, option, exc) from None


def client_tls_context(config: ClusterConfig) -> ssl.SSLContext | None:
    """The context a peer connects with (None when neither ``tls_ca`` nor ``tls_cert`` is set)."""
    if not (config.tls_ca or config.tls_cert):
        return None
    try:
        return _client_context(config.tls_cert, config.tls_key, config.tls_ca)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise _tls_files_error(config, "tls_ca" if config.tls_ca else "tls_cert", exc) from None


@attrs.frozen
class ServerSecurity:
    """What a listening node enforces: the token (empty: none) and TLS (None: plain)."""

    token: bytes = attrs.field(default=b"", repr=False)
    tls: ssl.SSLContext | None = None

    @classmethod
    def from_config(cls, config: ClusterConfig) -> ServerSecurity:
        return cls(load_token(config), server_tls_context(config))


@attrs.frozen
class ClientSecurity:
    """What a connecting peer proves and checks: the token (empty: none) and TLS (None: plain)."""

    token: bytes = attrs.field(default=b"", repr=False)
    tls: ssl.SSLContext | None = None

    @classmethod
    def from_config(cls, config: ClusterConfig) -> ClientSecurity:
        return cls(load_token(config), client_tls_context(config))


# -- safe defaults -------------------------------------------------------------------------------------

def is_loopback(addr: str) -> bool:
    """True for loopback addresses and ``localhost``; names that would need resolving are not."""
    text = addr.strip().strip("[]")
    if text.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def check_bind(host: str, security: ServerSecurity, *, insecure: bool, option: str = "bind_addr",
               source: str = "argument host", what: str = "server", warn: bool = True) -> None:
    """Refuse to listen on a non-loopback ``host`` without a cluster token, unless ``insecure``.

    Every server runs this itself before it listens (the data plane, the
    master's control service), so the rule holds whatever starts them. With
    ``insecure`` it warns loudly instead (unless ``warn`` is False), naming ``what``.
    """
    if is_loopback(host) or security.token:
        return
    if not insecure:
        raise ConfigError(
            option, host, source,
            f"a loopback address for this {what}, unless a cluster token is set (GENIE_AUTH_TOKEN or "
            "GENIE_AUTH_TOKEN_FILE): anyone who can reach this port could run code on its devices. Pass "
            "--insecure (the insecure option, GENIE_INSECURE=1) to serve without authentication anyway")
    if warn:
        log.warning("INSECURE: the %s serves %s WITHOUT AUTHENTICATION (--insecure): anyone who can reach it can "
                    "run code on this node's devices and read its tensors; set GENIE_AUTH_TOKEN", what, host)


def check_exposure(config: ClusterConfig, *, insecure: bool) -> None:
    """Refuse to serve a non-loopback address without a cluster token, unless ``insecure`` (or the option).

    Anyone who can reach an unauthenticated genie port can run code on its
    devices and read what other clients left there, so that must be a choice.
    The CLI calls this before it starts anything; the servers check again
    themselves (:func:`check_bind`) and each warns loudly when ``insecure`` lets it serve.
    """
    if is_loopback(config.bind_addr):
        return
    token = load_token(config)
    if token and server_tls_context(config) is None:
        log.warning("serving %s without TLS: the cluster token protects who may connect, but tensors and "
                    "ops cross the network unencrypted; set GENIE_TLS_CERT/GENIE_TLS_KEY", config.bind_addr)
    check_bind(config.bind_addr, ServerSecurity(token, None), insecure=insecure or config.insecure,
               source=_source(config, "bind_addr"), what="node", warn=False)
