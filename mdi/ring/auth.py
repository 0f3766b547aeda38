"""The optional shared secret: read from the environment or a file (never from the command
line, where other users could see it in the process list), checked on every HTTP request
and bound into each run's data-plane handshake."""
import hashlib
import hmac
import ipaddress
import os
import socket
import threading
from typing import Optional

TOKEN_ENV = "MDI_TOKEN"
TOKEN_FILE_ENV = "MDI_TOKEN_FILE"


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
    if expected is None:
        return True
    given = (authorization or "")[len("Bearer "):] if (authorization or "").startswith("Bearer ") else ""
    return hmac.compare_digest(given.encode(), expected.encode())


def ring_password(token: str, run_id: int) -> str:
    """Per-run data-plane password: a frame sender must know the token and the current run."""
    return hmac.new(token.encode(), b"mdi-ring-%d" % run_id, hashlib.sha256).hexdigest()


_auth_lock = threading.Lock()
_authenticator = None


def plain_authenticator(ctx):
    """One ZAP authenticator per process (zmq allows one per context)."""
    global _authenticator
    with _auth_lock:
        if _authenticator is None:
            from zmq.auth.thread import ThreadAuthenticator
            _authenticator = ThreadAuthenticator(ctx)
            _authenticator.start()
        return _authenticator


def is_loopback(host: str) -> bool:
    """Whether `host` only reaches this machine: binding anywhere else needs the secret."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # the short forms inet_aton accepts and the OS binds: 127.1, 127.0.1
        return ipaddress.ip_address(socket.inet_aton(host)).is_loopback
    except OSError:
        return False
