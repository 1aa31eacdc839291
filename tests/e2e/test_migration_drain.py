"""`pdtopo drain` of a D whose requests move (issue 50): real processes (1P2D, the Rust router),
`disaggregation.migration=true` (the KV moves) or `replay` (recomputed on the target). 16
clients stream 2,000-token greedy answers through the router (/generate streams, chat streams,
non-streamed completions); once decode_0 runs several of them it is drained: after
`launcher.migrate_after_s` its running requests move to decode_1, KV and client connection,
and the drain ends long before the answers do. Every client gets its whole answer, each token
once (a /generate stream's cumulative output_ids only ever extend), equal to the same request's
answer sent again afterwards, un-moved (asked once: both modes give the same answers); nothing
failed; decode_0 holds nothing and counts its moves in /metrics."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.support.constants import TINY_MODEL
from tests.support.e2e import Deployment, deployment_overrides, port_block, run_pdtopo

pytestmark = pytest.mark.slow

TOKENS = 2000
CLIENTS = 16
# the tiny model, deeper: a 2,000-token answer lasts long enough (> 15 s at batch 8) for the
# drain command to start while decode_0 runs it (not wider: its greedy tokens would depend on
# the batch size, which the moves change)
SLOW_ENOUGH = [TINY_MODEL, "model.num_layers=8"]
REFERENCE: dict[int, dict] = {}  # the un-moved answers: the same in both modes, asked once


def _body(i: int, stream: bool | None = None) -> tuple[str, dict]:
    kind = ("generate", "chat", "completion")[i % 3 if i < 9 else 0]
    if kind == "generate":
        return "/generate", {"text": f"stream {i}: tell me a story", "stream": True
                             if stream is None else stream,
                             "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0,
                                                 "ignore_eos": True}}
    common = {"model": "tiny", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    if kind == "chat":
        return "/v1/chat/completions", {**common, "stream": True if stream is None else stream,
                                        "messages": [{"role": "user", "content": f"chat {i}"}]}
    return "/v1/completions", {**common, "prompt": f"completion {i}", "stream": False}


def _answer(path: str, text: str, streamed: bool) -> dict:
    """What a client got: the ids or the text, and how it came."""
    if not streamed:
        d = json.loads(text)
        if path == "/generate":
            return {"ids": d["output_ids"]}
        choice = d["choices"][0]
        return {"text": choice.get("text", choice.get("message", {}).get("content"))}
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c][:1]
    if path == "/generate":
        ids = [c["output_ids"] for c in chunks]
        for a, b in zip(ids, ids[1:], strict=False):  # each token once, in order
            assert b[:len(a)] == a and len(b) > len(a), (len(a), len(b))
        return {"ids": ids[-1]}
    assert len({c["id"] for c in chunks}) == 1  # one response id, before and after the move
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    return {"text": "".join(c["choices"][0]["delta"].get("content") or ""
                            for c in chunks if c["choices"])}


def _engine_reqs(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/pdtopo/state", timeout=5).json().get("num_reqs", 0))
    except httpx.HTTPError:
        return 0


def _await_requests(url: str, want: int = CLIENTS // 2 - 2, settle_s: float = 10.0,
                    limit_s: float = 60.0) -> int:
    """The requests `url`'s engine holds once it holds `want`, or at least 2 after `settle_s`
    (the router's split of the clients need not be even: a worker it found slow to answer a
    health check gets fewer), or whatever it holds after `limit_s`."""
    start = time.monotonic()
    while (n := _engine_reqs(url)) < want and time.monotonic() - start < limit_s:
        if n >= 2 and time.monotonic() - start >= settle_s:
            break
        time.sleep(0.05)
    return n


def _router_workers(dep: Deployment) -> object:
    try:
        return httpx.get(f"{dep.proxy_url}/workers", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        return repr(exc)


@pytest.mark.parametrize("mode", ["true", "replay"])
def test_drain_moves_running_streams_and_ends_in_seconds(tmp_path, mode):
    dep = Deployment(tmp_path / "run", [
        *SLOW_ENOUGH, "topology=2p2d_cpu", "topology.prefill.instances=1",
        f"disaggregation.migration={mode}", "launcher.migrate_after_s=0.5",
        "engine.max_model_len=2304", "engine.max_new_tokens_limit=2200",
        "engine.page_size=16", "engine.num_pages=2600", "engine.max_running_requests=16",
        "proxy.health_check_interval_s=1", "proxy.health_failure_threshold=1",
        *deployment_overrides(port_block(40))]).launch()
    try:
        got: dict[int, dict | str] = {}

        def client(i: int) -> None:
            path, body = _body(i)
            try:
                with httpx.stream("POST", dep.proxy_url + path, json=body, timeout=300) as r:
                    text = r.read().decode()
                got[i] = (_answer(path, text, body["stream"]) if r.status_code == 200
                          else f"HTTP {r.status_code}: {text[:300]}")
            except Exception as exc:  # noqa: BLE001 - reported below
                got[i] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        d0 = dep.url("decode_0")
        running = _await_requests(d0)
        assert running >= 2, ("decode_0 never ran the clients' requests", running,
                               _engine_reqs(dep.url("decode_1")), _router_workers(dep))
        t0 = time.monotonic()
        res = run_pdtopo(["drain", "decode_0", str(dep.run_dir)], timeout=120)
        wall = time.monotonic() - t0
        assert res.returncode == 0, res.stdout + res.stderr
        print(res.stdout)
        moved = re.search(r"moved (\d+) running requests to decode_1", res.stdout)
        drained = re.search(r"decode_0 drained in ([\d.]+) s", res.stdout)
        assert moved and int(moved.group(1)) >= 1, res.stdout
        assert drained, res.stdout
        print(f"decode_0 ran {running} requests; drain: {drained.group(1)} s by its own count, "
              f"{wall:.1f} s with the CLI's start")
        assert float(drained.group(1)) < 10.0, res.stdout
        assert _engine_reqs(d0) == 0
        for t in threads:
            t.join(timeout=300)
        failed = {i: v for i, v in got.items() if isinstance(v, str)}
        assert not failed and len(got) == CLIENTS, failed

        # the same requests again, at once, un-moved (decode_1 serves them alone now): equal
        def reference(i: int) -> None:
            path, body = _body(i, stream=False)
            r = httpx.post(dep.proxy_url + path, json=body, timeout=300)
            REFERENCE[i] = (_answer(path, r.text, False) if r.status_code == 200
                            else {"error": r.text})

        threads = [threading.Thread(target=reference, args=(i,)) for i in range(CLIENTS)
                   if "error" in REFERENCE.get(i, {"error": "not asked yet"})]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        again = REFERENCE
        for i in range(CLIENTS):
            key = "ids" if "ids" in got[i] else "text"
            first = next((k for k, (a, b) in enumerate(zip(again[i].get(key, ""), got[i][key],
                                                           strict=False)) if a != b), None)
            assert again[i] == got[i], (i, "first difference at", first, again[i].get("error"))
            if key == "ids":
                assert len(got[i]["ids"]) == TOKENS

        metrics = httpx.get(f"{d0}/metrics", timeout=10).text
        out = re.search(r'^pdtopo:migrations_total\{direction="out",result="moved"\} (\S+)',
                        metrics, re.M)
        assert out and float(out.group(1)) == int(moved.group(1)), metrics[-2000:]
        d1_metrics = httpx.get(f"{dep.url('decode_1')}/metrics", timeout=10).text
        how = "moved" if mode == "true" else "replayed"  # KV pulled, or recomputed on decode_1
        line = f'pdtopo:migrations_total{{direction="in",result="{how}"}} {out.group(1)}'
        assert line in d1_metrics.splitlines(), d1_metrics[-2000:]
    finally:
        dep.stop_and_check()
