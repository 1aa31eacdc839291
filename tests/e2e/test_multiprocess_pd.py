"""Multi-process P and D instances end to end (real processes, CPU backend with gloo).

One deployment for the module, launched by `pdtopo launch --detach topology=1p1d_cpu_mp`:
bootstrap server, sglang-router, a prefill instance of 2 processes and a decode instance of 2
processes (one JAX cluster each, one emulated device per process, mesh tp=2 across the
processes; D process r pulls its KV shards from P process r). Greedy outputs through the router
must equal a colocated server's, token for token, for prompts spanning several pages. Then
single-process instances laid out otherwise join (started by hand, next to the deployment): a
D of 2 devices and one of 1 device pull from the 2-process P, and the 2-process D pulls from a
P of 2 devices in one process; the KV is resharded on the way and the tokens stay colocated.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import pytest

from tests.support.constants import greedy
from tests.support.e2e import (
    Deployment,
    baseline_problems,
    colocated_reference,
    deployment_overrides,
    generate,
    port_block,
    processes_of_run,
)
from tests.support.faults import program_pid, wait_until
from tests.support.multiprocess import ExtraProcesses, single_process_entry

pytestmark = pytest.mark.slow

OVERRIDES = ["model=tiny_llama", "model.num_layers=2", "engine.page_size=4", "engine.num_pages=128",
             "engine.max_running_requests=4", "engine.max_prefill_tokens=128",
             "engine.max_model_len=256"]
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "A long prompt that spans many KV pages of four tokens each, so that every prefill "
    "process gathers its shards of scattered pages and every decode process scatters them: ",
]
GREEDY = greedy(10)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    run = tmp_path_factory.mktemp("mp_run") / "run"
    base = port_block(60)
    overrides = ["topology=1p1d_cpu_mp", *OVERRIDES, *deployment_overrides(base),
                 f"topology.ports.coordinator_base={base + 40}",
                 f"topology.ports.control_base={base + 50}",
                 # CURVE on loopback: the side channel and the lockstep control channel both
                 "disaggregation.side_channel_curve=true"]
    dep = Deployment(run, overrides)
    try:
        dep.launch()
        yield dep
    finally:
        dep.stop()
        assert not processes_of_run(run), "processes of the run outlived pdtopo stop"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with colocated_reference(tmp_path_factory.mktemp("mp_colocated"), OVERRIDES, PROMPTS,
                             GREEDY) as ref:
        yield ref


def _state(url: str) -> dict:
    return httpx.get(f"{url}/pdtopo/state", timeout=10).json()


def test_every_rank_registered(deployment):
    boot = deployment.plan["bootstrap_url"]
    token = (deployment.run_dir / "token").read_text().strip()
    entries = httpx.get(f"{boot}/list", headers={"Authorization": f"Bearer {token}"},
                        timeout=10).json()
    by_role: dict[str, dict[int, dict]] = {}
    for e in entries:
        by_role.setdefault(e["role"], {})[e["tp_rank"]] = e
    for role in ("prefill", "decode"):
        ranks = by_role[role]
        assert sorted(ranks) == [0, 1], ranks
        assert ranks[0]["instance_id"] == ranks[1]["instance_id"] == f"{role}_0"
        assert ranks[0]["transfer_addr"] != ranks[1]["transfer_addr"]
        assert ranks[0]["kv_layout"]["num_processes"] == 2
        assert ranks[0]["kv_layout"]["tp"] == 2


def test_greedy_matches_colocated(deployment, reference):
    url = deployment.plan["proxy_url"]
    for prompt in PROMPTS:  # one at a time, then all at once (one batch, several rooms)
        out = generate(url, {"text": prompt, "sampling_params": GREEDY})
        assert out["output_ids"] == reference[prompt], prompt
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(
            lambda p: generate(url, {"text": p, "sampling_params": GREEDY}), PROMPTS))
    assert [o["output_ids"] for o in outs] == [reference[p] for p in PROMPTS]


def test_followers_ran_in_lockstep_and_released(deployment, reference):
    url = deployment.plan["proxy_url"]
    generate(url, {"text": PROMPTS[-1], "sampling_params": GREEDY})
    deadline = time.monotonic() + 10
    while True:
        p_lead, p_fol = (_state(deployment.url(n)) for n in ("prefill_0_p0", "prefill_0_p1"))
        d_lead, d_fol = (_state(deployment.url(n)) for n in ("decode_0_p0", "decode_0_p1"))
        idle = (p_lead["pd_registered_kv"] == 0 and p_fol["pd_registered_kv"] == 0
                and d_fol["pd_pulls"] == 0 and d_lead["free_pages"] == d_lead["total_pages"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, (p_lead, p_fol, d_lead, d_fol)
    # every forward of a leader ran on its follower too (warmup included)
    assert p_fol["num_forward"] >= p_lead["num_forward"] > 0
    assert d_fol["num_forward"] >= d_lead["num_forward"] > 0
    assert not baseline_problems(p_lead), baseline_problems(p_lead)
    # the followers joined their leaders over CURVE (disaggregation.side_channel_curve=true)
    assert p_fol["control_curve"] is True and d_fol["control_curve"] is True
    assert p_lead["pd_side_channel_curve"] is True and p_lead["pd_side_channel_received"] > 0


def test_pairs_split_differently_are_resharded(deployment, reference, tmp_path):
    """P spans 2 processes x 1 device; a second D instance is 1 process with 2 devices (the
    same tp=2, another process split), and a third a 1-device D (tp=1). Each pulls its pieces
    from both P processes (P's followers cut and register theirs) and decodes the colocated
    tokens; nothing stays registered. Then the reverse: D's 2-process instance pulls from a
    1-process P of 2 devices (each D process takes its shard from the one P process).
    The requests go to P and D directly, with the fields the router would inject."""
    p0 = deployment.process("prefill_0_p0")
    d_like = deployment.process("decode_0_p0")
    p_like = deployment.process("prefill_0_p0")
    entries = [single_process_entry(d_like, "decode_1", 2, tmp_path),
               single_process_entry(d_like, "decode_2", 1, tmp_path),
               single_process_entry(p_like, "prefill_1", 2, tmp_path)]
    extra = ExtraProcesses(tmp_path, deployment.run_dir, entries)
    try:
        extra.start()
        pairs = [(p0, entries[0]), (p0, entries[1]), (entries[2], deployment.process(
            "decode_0_p0"))]
        for k, (p_entry, d_entry) in enumerate(pairs):
            for n, prompt in enumerate(PROMPTS[2:]):
                body = {"text": prompt, "sampling_params": GREEDY,
                        "bootstrap_host": p_entry["address"],
                        "bootstrap_port": p_entry["ports"]["zmq"],
                        "bootstrap_room": 987654321 + 10 * k + n}
                p_url = f"http://{p_entry['address']}:{p_entry['ports']['http']}"
                d_url = f"http://{d_entry['address']}:{d_entry['ports']['http']}"
                with cf.ThreadPoolExecutor(2) as pool:
                    to_p = pool.submit(httpx.post, f"{p_url}/generate", json=body, timeout=120)
                    to_d = pool.submit(httpx.post, f"{d_url}/generate", json=body, timeout=120)
                    d_resp, p_resp = to_d.result(), to_p.result()
                assert p_resp.status_code == 200 and d_resp.status_code == 200, \
                    (k, p_resp.text, d_resp.text)
                assert d_resp.json()["output_ids"] == reference[prompt], (k, prompt)
        urls = ["prefill_0_p0", "prefill_0_p1"]
        deadline = time.monotonic() + 10
        while any(_state(deployment.url(n))["pd_registered_kv"] for n in urls) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        for n in urls:
            assert _state(deployment.url(n))["pd_registered_kv"] == 0, n
        for e in entries:
            st = _state(f"http://{e['address']}:{e['ports']['http']}")
            assert not baseline_problems(st), (e["name"], baseline_problems(st))
    finally:
        extra.stop()


def test_a_dead_follower_restarts_the_instance_as_a_whole(deployment, reference):
    """kill -9 P's follower process: the leader ends the requests in flight (no hang) and
    exits, the instance comes back as a whole under supervisord and serves the colocated
    tokens again. (Last in this module: it restarts P.)"""
    url = deployment.plan["proxy_url"]
    leader, follower = "prefill_0_p0", "prefill_0_p1"
    old_leader, old_follower = program_pid(deployment, leader), program_pid(deployment, follower)
    with cf.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(httpx.post, f"{url}/generate", timeout=120, json={
            "text": PROMPTS[-1], "sampling_params": {**GREEDY, "max_new_tokens": 64}})
        time.sleep(0.3)
        t_kill = time.monotonic()
        os.kill(old_follower, signal.SIGKILL)
        resp = inflight.result(timeout=90)  # ends: an answer (retried) or a clean error
        assert resp.status_code in (200, 500, 502, 503), resp.text
    wait_until(lambda: program_pid(deployment, leader) not in (0, old_leader), 60,
               what="the leader exited and was started again")
    wait_until(lambda: all(httpx.get(f"{deployment.url(n)}/health", timeout=2).status_code
                           == 200 for n in (leader, follower)), 180,
               what="the restarted instance healthy")
    restarted_s = time.monotonic() - t_kill
    wait_until(lambda: _serves(url), 120, what="serving again")
    for prompt in PROMPTS[:2]:
        got = generate(url, {"text": prompt, "sampling_params": GREEDY})
        assert got["output_ids"] == reference[prompt]
    print(f"follower killed: instance serving again after {restarted_s:.1f} s")


def _serves(url: str) -> bool:
    try:
        return httpx.post(f"{url}/generate", timeout=30, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    except httpx.HTTPError:
        return False
