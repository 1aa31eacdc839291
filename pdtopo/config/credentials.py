"""Who must show a credential over HTTP, and the proxy API key every layer agrees on.

    beyond_loopback(bind_host)              -> bool   (null = every interface: yes)
    http_auth_on(setting, role, bind_host, mode) -> bool   (`server.http_auth`, one server)
    derived_api_key(token)                  -> str    (the key when none is configured)
    read_api_key(environ)                   -> str | None

The planner decides (pure) which servers require a credential: `server.http_auth: auto`
turns it on for a P or D, or a colocated server behind the router (mode dp), that listens
beyond loopback (a colocated server of mode colocated is itself the clients' entry point and
stays open); true / false force it for every server role. Such a server accepts `Authorization: Bearer <key>` with the proxy's API key (what
the router sends on the client's behalf and for its own info calls) or the deployment token
(the launcher's admin calls). The key reaches a program through its environment:
`PDTOPO_PROXY_API_KEY` (from `proxy.api_key`, supervisord.conf 0600 or the k8s Secret),
`PDTOPO_PROXY_API_KEY_FILE` (a path, `proxy.api_key_file`), or, when the deployment needs a key
and none is configured, `PDTOPO_PROXY_API_KEY_DERIVED=1`: the key is an HMAC of the deployment
token, so every program and every host's launcher that holds the token computes the same one
(the launcher writes it to RUN/api_key for clients) and the key does not reveal the token.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping
from pathlib import Path

API_KEY_ENV = "PDTOPO_PROXY_API_KEY"
API_KEY_FILE_ENV = "PDTOPO_PROXY_API_KEY_FILE"
API_KEY_DERIVED_ENV = "PDTOPO_PROXY_API_KEY_DERIVED"
HTTP_AUTH_SETTINGS = ("auto", True, False)
AUTH_ROLES = ("prefill", "decode")  # who `auto` protects (and colocated servers of mode dp)
ALL_SERVER_ROLES = ("prefill", "decode", "colocated", "local")  # who `true` protects
OPEN_PATHS = frozenset({"/health", "/metrics"})  # the router's checks and the scrape

_LABEL = b"pdtopo proxy API key v1"


def beyond_loopback(bind_host: str | None) -> bool:
    if bind_host is None:
        return True  # every interface
    if bind_host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(bind_host).is_loopback
    except ValueError:
        return True  # a host name: assume routable


def http_auth_on(setting: str | bool, role: str, bind_host: str | None,
                 mode: str | None = "pd") -> bool:
    """`bind_host`: where the server listens (None: every interface); `mode`: the topology's
    (a colocated server behind the router in mode dp is guarded like P and D)."""
    if setting is True:
        return role in ALL_SERVER_ROLES
    if setting is False:
        return False
    behind_router = role in AUTH_ROLES or (role == "colocated" and mode == "dp")
    return behind_router and beyond_loopback(bind_host)


def derived_api_key(token: str) -> str:
    if not token:
        raise ValueError("the derived proxy API key comes from the deployment token, and this "
                         "process has none (PDTOPO_DEPLOYMENT_TOKEN)")
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).hexdigest()


def read_api_key(environ: Mapping[str, str], token: str | None) -> str | None:
    """The proxy's API key as a program's environment gives it, or None when it gives none.
    ValueError naming the config key when the key file cannot be read or is empty."""
    key = environ.get(API_KEY_ENV)
    if key:
        return key
    path = environ.get(API_KEY_FILE_ENV)
    if path:
        try:
            lines = Path(path).expanduser().read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"proxy.api_key_file={path!r}: cannot read it "
                             f"({exc.strerror or exc})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"proxy.api_key_file={path!r} is empty")
        return key
    if environ.get(API_KEY_DERIVED_ENV):
        return derived_api_key(token or "")
    return None
