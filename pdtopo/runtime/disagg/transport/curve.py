"""CURVE for the ZMQ side channel: the deployment's key pair and the authenticator that admits
only it.

    keys = deployment_keys(token)       # the same pair in every program of a deployment
    domain = admit_only(ctx, keys, on_denied)   # one ZAP authenticator per zmq.Context
    secure_router(router, keys, domain)         # P: CURVE server, before bind
    secure_dealer(dealer, keys)                 # D: CURVE client, before connect

The pair is derived from the deployment token (SHA-256 of a label and the token as the secret
key), so every program that holds the token (RUN/token, 0600; the k8s Secret) has it and no
other file has to travel. A peer completes the handshake only by proving it holds the secret
key (CURVE), and P's authenticator admits only the deployment's public key: a peer without the
token never gets a message to P's scheduler (it is not even a dropped message), and the traffic
is encrypted. `side_channel_curve(setting, bind_hosts)` decides whether it is on: `auto` turns it
on exactly when some P or D of the plan listens beyond loopback (`server.bind_host` null with
routable plan addresses, or a routable bind_host).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pdtopo.config.credentials import beyond_loopback

_LABEL = b"pdtopo side-channel CURVE key v1\0"
_ZAP_REBIND_S = 2.0  # how long a new authenticator waits for the old one's address


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes

    @property
    def domain(self) -> str:
        """The ZAP domain of this deployment's ROUTERs (several deployments in one process
        keep their own admission rule)."""
        return "pdtopo-" + hashlib.sha256(self.public).hexdigest()[:16]


def deployment_keys(token: str) -> CurveKeys:
    if not token:
        raise ValueError("the side channel's CURVE keys come from the deployment token, and "
                         "this process has none (PDTOPO_DEPLOYMENT_TOKEN)")
    secret = z85.encode(hashlib.sha256(_LABEL + token.encode()).digest())
    return CurveKeys(public=zmq.curve_public(secret), secret=secret)


def side_channel_curve(setting: str | bool, bind_hosts: list[str | None]) -> bool:
    """`disaggregation.side_channel_curve`: true / false, or auto = on when any P/D of the
    deployment listens beyond loopback (every program decides alike: P and D must agree)."""
    if isinstance(setting, bool):
        return setting
    return any(beyond_loopback(h) for h in bind_hosts)


class _AdmitOnly:
    def __init__(self, public: bytes, on_denied: Callable[[], None]) -> None:
        self.public = public
        self.on_denied = on_denied

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self.public:
            return True
        self.on_denied()
        return False


_lock = threading.Lock()
_authenticators: dict[int, tuple[ThreadAuthenticator, int]] = {}  # id(ctx) -> (auth, users)


def admit_only(ctx: zmq.Context, keys: CurveKeys, on_denied: Callable[[], None]) -> str:
    """Start (once per context) the ZAP authenticator and admit only `keys.public` in this
    deployment's domain; returns the domain. Pair with `release(ctx)`."""
    with _lock:
        auth, users = _authenticators.get(id(ctx), (None, 0))
        if auth is None:
            auth = _start_authenticator(ctx)
        auth.configure_curve_callback(domain=keys.domain,
                                      credentials_provider=_AdmitOnly(keys.public, on_denied))
        _authenticators[id(ctx)] = (auth, users + 1)
    return keys.domain


def _start_authenticator(ctx: zmq.Context) -> ThreadAuthenticator:
    """A running ZAP authenticator. The one a release() just stopped closes its socket
    asynchronously, so its inproc address can stay bound for a moment: retry briefly (measured:
    an immediate restart failed with EADDRINUSE about 1 run in 4)."""
    deadline = time.monotonic() + _ZAP_REBIND_S
    while True:
        auth = ThreadAuthenticator(ctx)
        try:
            auth.start()
            return auth
        except zmq.ZMQError as exc:
            auth.stop()
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def release(ctx: zmq.Context) -> None:
    with _lock:
        auth, users = _authenticators.get(id(ctx), (None, 0))
        if auth is None:
            return
        if users <= 1:
            del _authenticators[id(ctx)]
            auth.stop()
        else:
            _authenticators[id(ctx)] = (auth, users - 1)


def secure_router(sock: zmq.Socket, keys: CurveKeys, domain: str) -> None:
    sock.curve_server = True
    sock.zap_enforce_domain = True  # no authenticator for the domain: refuse, never admit
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.zap_domain = domain.encode()


def secure_dealer(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
