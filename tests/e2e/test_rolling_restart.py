"""`pdtopo drain` / `pdtopo restart` over real processes (2P2D, the Rust router): under a steady
load a rolling restart of every P, then every D, loses no request; every program has a new PID
afterwards and serves the colocated server's greedy tokens. P's drain waits for the rooms whose KV
it announced to a D that has not pulled yet (that D stopped meanwhile). Bad uses are refused with
the reason and change nothing: an unknown target, the last serving instance of a role without
--force, a wrong deployment token on /pdtopo/drain."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from pdtopo.launcher.operate.supervisor_control import Supervisor
from tests.support.constants import TWO_LAYERS, greedy
from tests.support.e2e import (
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
from tests.support.faults import wait_until

pytestmark = pytest.mark.slow

GREEDY = greedy(6)
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


class AnnouncedRoom:
    """One PD request whose KV P announces to a D that is stopped (SIGSTOP) before it pulls:
    D gets the request and asks P for the room, then stops; P prefills, sends `ready` and
    answers at once, its packed copy waiting in P's sender table for D's pull, which comes
    only after `resume()`. A drain of P that ended before that would stop P under the pull."""

    TOKENS = 8

    def __init__(self, dep: Deployment, sv: Supervisor, prefill: str, decode: str,
                 room: int) -> None:
        self.d_pid = sv.states()[decode][1]
        p = dep.process(prefill)
        body = {"text": f"announced room {room}", "bootstrap_host": p["address"],
                "bootstrap_port": p["ports"]["zmq"], "bootstrap_room": room,
                "sampling_params": {"max_new_tokens": self.TOKENS, "temperature": 0,
                                    "ignore_eos": True}}
        self.out: int | str | None = None

        def run_d() -> None:
            try:
                resp = httpx.post(f"{dep.url(decode)}/generate", json=body, timeout=120)
                self.out = (len(resp.json()["output_ids"]) if resp.status_code == 200
                            else f"{resp.status_code}: {resp.text[:300]}")
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                self.out = repr(exc)

        self.thread = threading.Thread(target=run_d, daemon=True)
        self.thread.start()
        time.sleep(1.0)  # D has the request and sent P its `want`
        os.kill(self.d_pid, signal.SIGSTOP)
        try:
            p_answer = httpx.post(f"{dep.url(prefill)}/generate", json=body, timeout=60)
        except httpx.HTTPError:
            self.resume()
            raise
        assert p_answer.status_code == 200, p_answer.text  # P's half: done, KV announced
        self.p_state = pool_state(dep.url(prefill))
        self.p_metrics = httpx.get(f"{dep.url(prefill)}/metrics", timeout=10).text

    def resume(self) -> None:
        os.kill(self.d_pid, signal.SIGCONT)

    def result(self) -> int | str | None:
        self.thread.join(120)
        return self.out


def _in_background(args: list[str]) -> tuple[threading.Thread, dict]:
    """`pdtopo ARGS` on a thread; its CompletedProcess lands in the dict's "res"."""
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(res=run_pdtopo(args, timeout=900)))
    thread.start()
    return thread, done


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with colocated_reference(tmp_path_factory.mktemp("colocated"), TWO_LAYERS, PROMPTS,
                             GREEDY) as ref:
        yield ref


def test_rolling_restart_of_every_p_then_every_d_loses_nothing(tmp_path_factory, reference):
    run_dir = tmp_path_factory.mktemp("rolling") / "run"
    dep = Deployment(run_dir, [*TWO_LAYERS, "topology=2p2d_cpu", "engine.max_model_len=4096",
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
                announced = None
                if role == "prefill":  # prefill_0, drained first, holds KV decode_1 has
                    # not pulled: decode_1 is stopped until after prefill_0's drain began
                    announced = AnnouncedRoom(dep, sv, "prefill_0", "decode_1", 4343)
                restart, done = _in_background(["restart", role, str(run_dir)])
                if announced is not None:
                    try:  # past the drain's first in_flight check: its way out of the router
                        wait_until(lambda: pool_state(dep.url("prefill_0"))["draining"], 60)
                        time.sleep(8)
                    finally:
                        announced.resume()
                restart.join(900)
                res = done["res"]
                assert res.returncode == 0, res.stdout + res.stderr + dep.log_tails(20)
                if announced is not None:  # its KV waited for the pull, then D decoded it
                    assert announced.result() == AnnouncedRoom.TOKENS, res.stdout
                    st = announced.p_state
                    assert st["pd_inflight_senders"] >= 1 and st["in_flight"] >= 1, st
                    assert 0 < st["pd_held_kv_pages"] <= st["pd_max_held_kv_pages"], st
                    assert _metric(announced.p_metrics, "pdtopo:held_kv_bytes") > 0
                    waited = re.search(r"prefill_0: draining \(\d+ HTTP requests open, (\d+) "
                                       r"requests in the engine\)", said(res))
                    assert waited and int(waited.group(1)) >= 1, res.stdout
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
