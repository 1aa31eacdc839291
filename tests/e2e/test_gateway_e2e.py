"""2P2D behind the sglang model gateway (`proxy=gateway`, prefill policy `cache_aware`), real
processes: greedy tokens equal a colocated server's; a conversation's prompt sent again lands
on the P that cached it (round robin would alternate three prompts over two P, and every
second-round request would miss); OpenAI chat, plain and streamed, passes through; a body over
server.max_body_bytes is refused 413 at once; and
`pdtopo stop` leaves no gateway behind (it renames its process, so the run-dir scan alone
would not see it)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pdtopo.launcher.operate.supervisor_control import Supervisor
from tests.support.constants import TWO_LAYERS, greedy
from tests.support.e2e import (
    Deployment,
    assert_refused_at_once,
    colocated_reference,
    deployment_overrides,
    generate,
    pid_alive,
    port_block,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

GREEDY = greedy(6)
# three long prompts with distinct beginnings: several full pages each
PROMPTS = [f"Conversation {name}: " + f"the {name} user asks about paged attention " * 8
           for name in ("red", "green", "blue")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with colocated_reference(tmp_path_factory.mktemp("colocated"), TWO_LAYERS, PROMPTS,
                             GREEDY) as ref:
        yield ref


def test_gateway_cache_aware_keeps_prompts_on_their_prefill(tmp_path_factory, reference):
    run_dir = tmp_path_factory.mktemp("gateway") / "run"
    dep = Deployment(run_dir, [*TWO_LAYERS, "topology=2p2d_cpu", "proxy=gateway",
                               *deployment_overrides(port_block(40))]).launch()
    proxy_pid = None
    try:
        proxy_pid = Supervisor(run_dir).states()["proxy"][1]
        first = [generate(dep.proxy_url, {"text": p, "sampling_params": GREEDY}, 300)
                 for p in PROMPTS]
        assert [o["output_ids"] for o in first] == [reference[p] for p in PROMPTS]
        assert [o["meta_info"]["cached_tokens"] for o in first] == [0, 0, 0]
        again = [generate(dep.proxy_url, {"text": p, "sampling_params": GREEDY}, 300)
                 for p in PROMPTS]
        assert [o["output_ids"] for o in again] == [reference[p] for p in PROMPTS]
        cached = [o["meta_info"]["cached_tokens"] for o in again]
        prompt_tokens = [o["meta_info"]["prompt_tokens"] for o in again]
        # every prompt hit its P's tree for all its full pages but the last token's
        assert all(c > 0 and c >= t - 16 for c, t in zip(cached, prompt_tokens, strict=True)), \
            (cached, prompt_tokens)

        model = httpx.get(f"{dep.proxy_url}/v1/models", timeout=10).json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}],
                "max_tokens": 4, "temperature": 0}
        body = httpx.post(f"{dep.proxy_url}/v1/chat/completions", json=chat, timeout=120)
        assert body.status_code == 200, body.text
        assert body.json()["usage"]["completion_tokens"] == 4
        events = []
        with httpx.stream("POST", f"{dep.proxy_url}/v1/chat/completions",
                          json={**chat, "stream": True}, timeout=120) as resp:
            assert resp.status_code == 200
            events = [line[5:].strip() for line in resp.iter_lines()
                      if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # n > 1 with logprobs through the gateway: one body to P and D, a room per completion
        many = {**chat, "n": 3, "temperature": 1.0, "seed": 5, "logprobs": True,
                "top_logprobs": 2, "ignore_eos": True}
        runs = []
        for _ in range(2):
            resp = httpx.post(f"{dep.proxy_url}/v1/chat/completions", json=many, timeout=120)
            assert resp.status_code == 200, resp.text
            runs.append(resp.json()["choices"])
        assert [c["index"] for c in runs[0]] == [0, 1, 2]
        # per choice: its tokens and their logprobs (rounded: a prefix-cache hit on the second
        # run changes the prompt's KV in the last float bits, not the choices)
        picks = [[str([(e["token"], round(e["logprob"], 3)) for e in c["logprobs"]["content"]])
                  for c in run] for run in runs]
        assert picks[0] == picks[1] and len(set(picks[0])) == 3, picks
        assert all(len(c["logprobs"]["content"]) == 4 for c in runs[0])
        # server.max_body_bytes is the gateway's --max-payload-size: 413, nothing forwarded
        assert_refused_at_once(dep.proxy_url)
        wait_pools_baseline(dep)
    finally:
        dep.stop_and_check()
    deadline = time.monotonic() + 5
    while proxy_pid and pid_alive(proxy_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proxy_pid and not pid_alive(proxy_pid), "the gateway outlived pdtopo stop"
