"""The optional shared secret: read from the environment or a file (never from the command
line, where other users could see it in the process list). The secret itself never crosses
the network:

- control plane (HTTP): every request carries an HMAC-SHA256 signature over its method, path,
  body hash, a timestamp, a nonce and the worker it is for (`sign_request`, checked by
  `RequestVerifier`), in `Authorization: MDI-HMAC t=<unix time>, n=<nonce>, i=<instance>,
  s=<hex signature>`; a request is accepted once, within `REPLAY_WINDOW` seconds of the worker's
  clock, and only by the worker process it names (its random instance id: a request captured on
  the way to one worker is refused by every other, and by the same one once it restarted). A
  worker answers a request signed with the secret but for another time or instance with a 401
  that carries its clock and instance id (TIME_HEADER, INSTANCE_HEADER): the starter signs again;
- data plane (zmq): each run's CURVE key pairs derive from the secret and the run id
  (`ring_password` -> `ring_keys`), so only nodes that know both can connect, every frame is
  encrypted, and what a neighbour sends cannot be read or altered on the way.
"""
import hashlib
import heapq
import hmac
import os
import re
import secrets
import threading
import time
from typing import List, NamedTuple, Optional, Tuple

TOKEN_ENV = "MDI_TOKEN"
TOKEN_FILE_ENV = "MDI_TOKEN_FILE"

SCHEME = "MDI-HMAC"
CONTENT_HEADER = "X-MDI-Content-SHA256"  # the body's sha256 (hex), signed; or UNSIGNED_PAYLOAD
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"  # only for POST /weights: its sha256 was announced in /init
TIME_HEADER = "X-MDI-Time"  # a worker's clock, sent back with a signed but stale request
INSTANCE_HEADER = "X-MDI-Instance"  # a worker process's instance id, sent back likewise
UNKNOWN_INSTANCE = "0" * 16  # what a starter signs for before it has heard a worker's id
REPLAY_WINDOW = 60.0  # seconds either side of the worker's clock
MAX_NONCES = 1 << 16  # nonces remembered at most (requests within one window)

_INSTANCE_HEX = r"[0-9a-f]{16}"  # a worker process's instance id: 8 random bytes
_HEADER = re.compile(r"^MDI-HMAC t=(\d{1,12}), n=([0-9a-f]{16,64}), i=(%s), s=([0-9a-f]{64})$" % _INSTANCE_HEX)
INSTANCE = re.compile(r"^%s$" % _INSTANCE_HEX)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class TokenError(ValueError):
    pass


def load_token(token_file: Optional[str] = None) -> Optional[str]:
    """The secret from `token_file`, else $MDI_TOKEN_FILE, else $MDI_TOKEN; None when unset."""
    path = token_file or os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise TokenError("cannot read the token file %s: %s" % (path, e.strerror))
        if not token:
            raise TokenError("token file %s is empty" % path)
        return token
    return os.environ.get(TOKEN_ENV) or None


def token_matches(expected: Optional[str], authorization: Optional[str]) -> bool:
    """`Authorization: Bearer <secret>`: only for the OpenAI-compatible API (`--serve`), whose
    clients send their API key that way; the workers' control plane uses `RequestVerifier`."""
    if expected is None:
        return True
    given = (authorization or "")[len("Bearer "):] if (authorization or "").startswith("Bearer ") else ""
    return hmac.compare_digest(given.encode(), expected.encode())


# --- control plane: signed requests ---------------------------------------------------------

def _derive(key: str, label: bytes) -> bytes:
    return hmac.new(key.encode(), label, hashlib.sha256).digest()


def body_sha256(body: Optional[bytes]) -> str:
    return hashlib.sha256(body or b"").hexdigest()


def _message(method: str, path: str, content_sha256: str, t: str, nonce: str, instance: str) -> bytes:
    return "\n".join((SCHEME, method.upper(), path, content_sha256, t, nonce, instance)).encode("utf-8")


def new_instance() -> str:
    """A worker process's random instance id (never UNKNOWN_INSTANCE)."""
    while True:
        instance = secrets.token_hex(8)
        if instance != UNKNOWN_INSTANCE:
            return instance


def sign_request(token: str, method: str, path: str, content_sha256: str, now: Optional[float] = None,
                 nonce: Optional[str] = None, instance: str = UNKNOWN_INSTANCE) -> str:
    """The Authorization header of one request to the worker process `instance`. `path`
    includes the query (`/status?run=3`); `content_sha256` is `body_sha256(body)` or
    UNSIGNED_PAYLOAD (also sent in CONTENT_HEADER)."""
    t = "%d" % int(time.time() if now is None else now)
    n = nonce or secrets.token_hex(16)
    s = hmac.new(_derive(token, b"mdi-control-v1"), _message(method, path, content_sha256, t, n, instance),
                 hashlib.sha256).hexdigest()
    return "%s t=%s, n=%s, i=%s, s=%s" % (SCHEME, t, n, instance, s)


class AuthError(ValueError):
    """A control request that is not signed with the shared secret (or is a replay). `stale`:
    the signature is right but its time is outside the window (the clocks disagree), or it
    names another worker process (its starter has not heard this one's instance id yet)."""

    def __init__(self, message: str, stale: bool = False, nonce: Optional[str] = None) -> None:
        super().__init__(message)
        self.stale, self.nonce = stale, nonce  # (a stale signature's nonce: RequestVerifier.spend)


class RequestVerifier:
    """Checks signed control requests: signature (constant-time), time window, and that no
    nonce is accepted twice. Memory is bounded: a nonce is kept only until its timestamp
    leaves the window, and at most `max_nonces` at a time."""

    def __init__(self, token: str, instance: Optional[str] = None, window: float = REPLAY_WINDOW,
                 max_nonces: int = MAX_NONCES) -> None:
        self._key = _derive(token, b"mdi-control-v1")
        self.instance = instance  # this worker process's id, which a request must name (None: any)
        self.window, self.max_nonces = window, max_nonces
        self._lock = threading.Lock()
        self._seen: set = set()
        self._expiry: List[Tuple[float, str]] = []  # heap of (forget after, nonce)

    def verify(self, method: str, path: str, authorization: Optional[str], content_sha256: Optional[str],
               now: Optional[float] = None) -> None:
        """Returns if the request is authentic and new; raises AuthError otherwise."""
        t, nonce = self.check_signed(method, path, authorization, content_sha256, now)
        self.spend(nonce, int(t) + self.window, now)

    def seen(self, nonce: str, now: Optional[float] = None) -> bool:
        """Whether `nonce` was spent (and is still remembered): a replay, refused from its headers."""
        with self._lock:
            self._forget(time.time() if now is None else now)
            return nonce in self._seen

    def spend(self, nonce: str, until: float, now: Optional[float] = None) -> None:
        """Remember `nonce` until `until`; AuthError if it was spent already, or if too many are."""
        with self._lock:
            self._forget(time.time() if now is None else now)
            if nonce in self._seen:
                raise AuthError("replayed request")
            if len(self._seen) >= self.max_nonces:
                raise AuthError("too many requests within %.0f s" % self.window)
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (until, nonce))

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])

    def check_signed(self, method: str, path: str, authorization: Optional[str], content_sha256: Optional[str],
                     now: Optional[float] = None) -> Tuple[str, str]:
        """(t, nonce) of a request signed with the secret within the window, from its headers
        alone (the body's sha256 is the header's claim); AuthError otherwise. Remembers no
        nonce: `verify` does, once the body is there to check against its claim."""
        m = _HEADER.match(authorization or "")
        if m is None:
            raise AuthError("no %s signature" % SCHEME)
        if content_sha256 != UNSIGNED_PAYLOAD and not _HEX64.match(content_sha256 or ""):
            raise AuthError("missing or malformed %s header" % CONTENT_HEADER)
        t, nonce, instance, sig = m.groups()
        expected = hmac.new(self._key, _message(method, path, content_sha256 or "", t, nonce, instance),
                            hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected.encode(), sig.encode()):
            raise AuthError("bad signature")
        now = time.time() if now is None else now
        if abs(now - int(t)) > self.window:
            raise AuthError("signed %+.0f s from this node's clock (window %.0f s)" % (int(t) - now, self.window),
                            stale=True, nonce=nonce)
        if self.instance is not None and instance != self.instance:
            raise AuthError("signed for another worker process (or for this one before it restarted)", stale=True,
                            nonce=nonce)
        return t, nonce


# --- data plane: CURVE keys -----------------------------------------------------------------

def ring_password(token: str, run_id: int) -> str:
    """The per-run data-plane secret: never sent, it only seeds the run's CURVE keys
    (`ring_keys`), so a node must know the token and the current run to join the ring."""
    return _derive(token, b"mdi-ring-%d" % run_id).hex()


class RingKeys(NamedTuple):
    """Z85-encoded curve25519 keys of one run: every node's PULL socket is the server, every
    PUSH socket the client; each side checks the other's public key."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def ring_keys(ring_secret: str) -> RingKeys:
    """Both key pairs, derived deterministically (HMAC-SHA256 with distinct labels -> 32-byte
    curve25519 secret keys; libzmq computes the public halves)."""
    import zmq
    from zmq.utils import z85
    pairs = []
    for label in (b"mdi-curve-server-v1", b"mdi-curve-client-v1"):
        secret = z85.encode(_derive(ring_secret, label))
        pairs += [zmq.curve_public(secret), secret]
    return RingKeys(*pairs)


class _AllowKey:
    """CURVE callback of one endpoint's ZAP domain: only this run's client key may connect."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


_auth_lock = threading.Lock()
_authenticator = None


def ring_authenticator(ctx):
    """One ZAP authenticator per process (zmq allows one per context)."""
    global _authenticator
    with _auth_lock:
        if _authenticator is None:
            from zmq.auth.thread import ThreadAuthenticator
            _authenticator = ThreadAuthenticator(ctx)
            _authenticator.start()
        return _authenticator


def allow_client(ctx, domain: str, client_public: Optional[bytes]) -> None:
    """Let only `client_public` connect to sockets of ZAP `domain` (None: forget the domain)."""
    auth = ring_authenticator(ctx)
    if client_public is None:
        auth.credentials_providers.pop(domain, None)
    else:
        auth.configure_curve_callback(domain, _AllowKey(client_public))
