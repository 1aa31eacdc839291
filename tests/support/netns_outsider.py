"""What a peer on the deployment's network that is not part of it tries, run inside its own
network namespace by tests/e2e/test_netns.py: `python -m tests.support.netns_outsider ACTION JSON_ARGS`
prints one JSON object.

    http        {method, url, headers?, json?}        -> {status, body}
    pair        {p_url, d_url, body, headers?}        -> {p: {status, body}, d: {...}}
    side_channel {address, server_public_z85}          -> {sent: [...]}

`side_channel` sends `want`/`done` messages to P's ZMQ ROUTER three ways: a plain DEALER (no
CURVE), a SideChannel holding another deployment's key pair, and a DEALER that knows P's public
key (no secret) but presents a key pair of its own. None of them holds the deployment's secret.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time

import httpx
import zmq

from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.curve import deployment_keys
from pdtopo.runtime.disagg.transport.side_channel import SideChannel


def _http(method: str, url: str, headers: dict | None = None, json_body: dict | None = None
          ) -> dict:
    res = httpx.request(method, url, headers=headers or {}, json=json_body, timeout=120)
    try:
        body = res.json()
    except ValueError:
        body = res.text
    return {"status": res.status_code, "body": body}


def http(args: dict) -> dict:
    return _http(args["method"], args["url"], args.get("headers"), args.get("json"))


def pair(args: dict) -> dict:
    """The same body to P and D at once, the way the router sends a PD request."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p, d = pool.map(lambda url: _http("POST", url, args.get("headers"), args["body"]),
                        [args["p_url"], args["d_url"]])
    return {"p": p, "d": d}


def side_channel(args: dict) -> dict:
    address = args["address"]
    ctx = zmq.Context.instance()
    plain = SideChannel(max_bytes=4096, name="outsider-plain")
    stranger = SideChannel(max_bytes=4096, name="outsider-stranger",
                           curve=deployment_keys("another deployment's token"))
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.curve_serverkey = args["server_public_z85"].encode()  # z85, as zmq takes it
    forger.curve_publickey, forger.curve_secretkey = zmq.curve_keypair()
    forger.connect(f"tcp://{address}")
    sent = []
    try:
        for room in (901, 902, 903):
            for ch in (plain, stranger):
                ch.send_to(address, m.Want(room=room))
                ch.send_to(address, m.Done(room=room, ok=True))
            forger.send(m.encode(m.Want(room=room)))
            sent.append(room)
        time.sleep(2.0)  # let every handshake run its course
    finally:
        forger.close()
        plain.close()
        stranger.close()
    return {"sent": sent}


ACTIONS = {"http": http, "pair": pair, "side_channel": side_channel}

if __name__ == "__main__":
    print(json.dumps(ACTIONS[sys.argv[1]](json.loads(sys.argv[2]))))
