"""`pdtopo drain` / `pdtopo restart` over real processes (2P2D, the Rust router): under a steady
load a rolling restart of every P, then every D, loses no request; every program has a new PID
afterwards and serves the colocated server's greedy tokens. Bad uses are refused with the reason
and change nothing: an unknown target, the last serving instance of a role without --force, a
wrong deployment token on /pdtopo/drain."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from pdtopo.launcher.supervisor_control import Supervisor
from tests.e2e_support import (
    Deployment,
    SteadyLoad,
    colocated_reference,
    deployment_overrides,
    generate,
    pool_state,
    port_block,
    run_pdtopo,
    said,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

MODEL = ["model.num_layers=2"]
GREEDY = {"max_new_tokens": 6, "temperature": 0}
LONG_TOKENS = 3000  # ~10 s of decoding: decode_0 is drained while it runs
PROMPTS = [f"Steady request {i}: tell me about rolling restarts" for i in range(4)]


class LongRequest:
    """One LONG_TOKENS-token PD request sent the way the router sends it (the same body with
    P's bootstrap address and a room to P and to one chosen D, at once), on threads, so that it
    runs on that D for certain; `result()` is the number of tokens D answered (or the error)."""

    def __init__(self, dep: Deployment, prefill: str, decode: str, room: int) -> None:
        p = dep.process(prefill)
        self.out: int | str | None = None
        body = {"text": f"long request {room}", "bootstrap_host": p["address"],
                "bootstrap_port": p["ports"]["zmq"], "bootstrap_room": room,
                "sampling_params": {"max_new_tokens": LONG_TOKENS, "temperature": 0,
                                    "ignore_eos": True}}

        def post(url: str) -> httpx.Response:
            return httpx.post(f"{url}/generate", json=body, timeout=300)

        def run_p() -> None:
            post(dep.url(prefill))

        def run_d() -> None:
            try:
                resp = post(dep.url(decode))
                self.out = (len(resp.json()["output_ids"]) if resp.status_code == 200
                            else f"{resp.status_code}: {resp.text[:200]}")
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                self.out = repr(exc)

        self.threads = [threading.Thread(target=f, daemon=True) for f in (run_p, run_d)]
        for t in self.threads:
            t.start()

    def result(self) -> int | str | None:
        for t in self.threads:
            t.join(300)
        return self.out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with colocated_reference(tmp_path_factory.mktemp("colocated"), MODEL, PROMPTS,
                             GREEDY) as ref:
        yield ref


def test_rolling_restart_of_every_p_then_every_d_loses_nothing(tmp_path_factory, reference):
    run_dir = tmp_path_factory.mktemp("rolling") / "run"
    dep = Deployment(run_dir, [*MODEL, "topology=2p2d_cpu", "engine.max_model_len=4096",
                               "engine.max_new_tokens_limit=4096",
                               *deployment_overrides(port_block(40))]).launch()
    try:
        sv = Supervisor(run_dir)
        before = {name: pid for name, (_state, pid) in sv.states().items()}

        bad = run_pdtopo(["restart", "prefill_7", str(run_dir)])
        assert bad.returncode == 1 and "'prefill_7' is not a prefill/decode program" in \
            bad.stdout, bad.stdout
        wrong = httpx.post(f"{dep.url('prefill_0')}/pdtopo/drain", json={"drain": True},
                           headers={"Authorization": "Bearer not-the-token"}, timeout=10)
        assert wrong.status_code == 401 and "deployment token" in wrong.text
        assert pool_state(dep.url("prefill_0"))["draining"] is False

        # drain P0, then try the last serving P: refused; undo puts P0 back
        drained = run_pdtopo(["drain", "prefill_0", str(run_dir)], timeout=180)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert "out of the router" in said(drained) and "drained" in said(drained)
        assert httpx.get(f"{dep.url('prefill_0')}/health", timeout=5).status_code == 503
        last = run_pdtopo(["drain", "prefill_1", str(run_dir)], timeout=60)
        assert last.returncode == 1 and "no other prefill instance is serving" in said(last), \
            last.stdout
        assert pool_state(dep.url("prefill_1"))["draining"] is False
        undone = run_pdtopo(["drain", "prefill_0", str(run_dir), "--undo"], timeout=120)
        assert undone.returncode == 0 and "back in the router" in said(undone), undone.stdout
        assert httpx.get(f"{dep.url('prefill_0')}/health", timeout=5).status_code == 200

        with SteadyLoad(dep.proxy_url) as load:
            time.sleep(2)
            for role in ("prefill", "decode"):
                long_ones = []
                if role == "decode":  # decode_0, drained first, is decoding a long request
                    long_ones = [LongRequest(dep, "prefill_1", "decode_0", 4242)]
                    deadline = time.monotonic() + 30
                    while (pool_state(dep.url("decode_0"))["http_in_flight"] == 0
                           and long_ones[0].out is None and time.monotonic() < deadline):
                        time.sleep(0.05)
                res = run_pdtopo(["restart", role, str(run_dir)], timeout=900)
                assert res.returncode == 0, res.stdout + res.stderr + dep.log_tails(20)
                assert said(res).count("back in the router") == 2, res.stdout
                print(res.stdout)  # the steps and their times (docs/reliability.md)
                for req in long_ones:  # the drain waited for them: complete answers
                    assert req.result() == LONG_TOKENS, res.stdout
                if role == "decode":  # ... and its drain began with that request open
                    busy = re.findall(r"draining \((\d+) HTTP requests open", said(res))
                    assert len(busy) == 2 and int(busy[0]) >= 1, res.stdout
            time.sleep(2)
        assert load.failures == [], load.failures[:5]
        assert load.ok > 20, load.ok  # the load ran through all four restarts
        print(f"steady load: {load.ok} requests answered, {len(load.failures)} failed")

        after = {name: pid for name, (_state, pid) in sv.states().items()}
        for name in ("prefill_0", "prefill_1", "decode_0", "decode_1"):
            assert after[name] != before[name], name
        assert after["proxy"] == before["proxy"] and after["bootstrap"] == before["bootstrap"]
        for prompt in PROMPTS:
            out = generate(dep.proxy_url, {"text": prompt, "sampling_params": GREEDY})
            assert out["output_ids"] == reference[prompt], prompt
        wait_pools_baseline(dep)
    finally:
        dep.stop_and_check()
