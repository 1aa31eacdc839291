"""Reliability under faults, over real processes (bootstrap, sglang-router, P, D under
supervisord): P killed mid-flight, D killed mid-flight, the bootstrap server killed and a P whose
heartbeats stop, then a 1,000-request leak soak. One deployment is shared by the module; every
test leaves it serving and at its baseline. Measured numbers are printed (`-s`) and recorded in
docs/reliability.md.

Deployment settings (tests/support/faults.py): kv_timeout_s = sender_expiry_s = 5, heartbeat 1 s,
TTL 3 s, router retries and circuit breaker off, router health checks every second.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time

import httpx
import pytest

from tests.support.e2e import leaked_pages, pool_state, processes_of_run, wait_pools_baseline
from tests.support.faults import (
    KV_TIMEOUT_S,
    SENDER_EXPIRY_S,
    TTL_S,
    Background,
    abort_stream,
    bootstrap_list,
    kill9,
    launch_fault_deployment,
    post_generate,
    program_pid,
    rss_mib,
    run_concurrently,
    wait_restarted,
    wait_serving,
    wait_until,
)

pytestmark = pytest.mark.slow

# A failed request must reach the client within the KV timeout plus router / scheduling overhead
# (generous: the CI machine has 2 contended cores).
ERROR_DEADLINE_S = KV_TIMEOUT_S + 10
# With proxy.retries=0 (this module's deployment), the requests a dead P leaves behind get their
# error this soon after the kill: D learns of the death from the side channel's disconnect, not
# from its KV timer (issue 16's acceptance; measured 0.25-0.75 s)
P_DEATH_ERROR_S = 2.0
LONG = "abcdefghij" * 70  # ~700 tokens: 44 KV pages per request, prefills take a while
# Enough long requests that P still has a queue while earlier KV waits for / is in a pull.
MID_FLIGHT_REQUESTS = 96


def report(name: str, **numbers) -> None:
    print(f"\n[reliability] {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    d = None
    try:
        d = launch_fault_deployment(run_dir)
        yield d
    finally:
        if d is not None:
            keep = os.environ.get("PDTOPO_FAULT_LOGS")  # copy the logs for a post-mortem
            if keep:
                import shutil
                shutil.copytree(run_dir / "logs", keep, dirs_exist_ok=True)
            d.stop()
        else:
            from tests.support.e2e import run_pdtopo
            run_pdtopo(["stop", str(run_dir)], timeout=120)
        wait_until(lambda: not processes_of_run(run_dir), 30, what="run's processes gone")


def long_request(i: int, max_new_tokens: int = 16) -> dict:
    return {"text": f"{i} {LONG}", "sampling_params": {"max_new_tokens": max_new_tokens,
                                                      "temperature": 0}}


def short_request(i: int) -> dict:
    return {"text": f"after {i}: hello", "sampling_params": {"max_new_tokens": 4,
                                                           "temperature": 0}}


def health_generate_ok(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def wait_mid_flight(pred, bg: Background, seen: dict, what: str) -> None:
    """wait_until(pred), failing with the last states seen and what the requests got."""
    try:
        wait_until(pred, 60, interval=0.05, what=what)
    except TimeoutError as exc:
        keys = ("num_waiting", "num_running", "num_reqs", "pd_registered_kv", "pd_transfers")
        states = {side: {k: st.get(k) for k in keys} for side, st in seen.items()}
        raise AssertionError(f"{exc}; last states {states}; finished requests by status "
                             f"{bg.finished()}") from exc


def assert_clean_errors(outs, t_kill: float, deadline_s: float = ERROR_DEADLINE_S) -> None:
    """Every request either succeeded or got a 5xx error body within the deadline of the kill
    (or of its own start, if it started later)."""
    for o in outs:
        if o.status == 200:
            assert len(o.output_ids) >= 1
            continue
        assert o.status is not None and 500 <= o.status < 600, f"unexpected outcome {o}"
        waited = min(o.latency_s, o.t_end - t_kill)
        assert waited <= deadline_s, f"error {waited:.1f}s after the kill: {o}"
        assert "error" in o.body, o


def test_prefill_killed_mid_flight(dep):
    """kill -9 P while requests are queued for prefill, registered for a pull and being pulled:
    each ends with an error within 2 s of the kill (no hang, no KV timeout), D keeps working, P comes back,
    re-registers, new requests succeed, pools return to baseline."""
    p_url, d_url = dep.url("prefill_0"), dep.url("decode_0")
    bg = Background([lambda i=i: post_generate(dep.proxy_url, long_request(i))
                     for i in range(MID_FLIGHT_REQUESTS)], workers=MID_FLIGHT_REQUESTS)
    seen: dict = {}

    def mid_flight() -> bool:  # requests waiting for prefill AND KV waiting for / in a pull
        seen["p"], seen["d"] = pool_state(p_url), pool_state(d_url)
        return seen["p"]["num_waiting"] > 0 and (
            seen["p"]["pd_registered_kv"] > 0 or seen["d"]["pd_transfers"] > 0)
    wait_mid_flight(mid_flight, bg, seen, "P busy with prefill and transfers")
    t_kill = time.monotonic()
    old = kill9(dep, "prefill_0")

    # D keeps serving (its local health generation) while P is down.
    assert health_generate_ok(d_url)
    outs = bg.result(timeout=120)
    t_all_answered = time.monotonic() - t_kill
    failed = [o for o in outs if o.status != 200]
    assert failed, "killing P mid-flight failed no request"
    assert_clean_errors(outs, t_kill, deadline_s=P_DEATH_ERROR_S)
    assert any("kv_timeout_s" in o.body or "KV" in o.body for o in failed), failed[:3]
    # D learned that P is gone from the side channel's disconnect, not from its KV timeout
    assert any("disconnected" in o.body for o in failed), failed[:3]

    restart_s = wait_restarted(dep, "prefill_0", old)
    reregistered_s = wait_until(lambda: any(
        e["instance_id"] == "prefill_0" and e["age_s"] < TTL_S for e in bootstrap_list(dep, "prefill")),
        30, what="P registered again")
    serving_s = wait_serving(dep.proxy_url, timeout=60)
    recovery_s = time.monotonic() - t_kill
    ok = run_concurrently([lambda i=i: post_generate(dep.proxy_url, short_request(i))
                           for i in range(8)], workers=8)
    assert [o.status for o in ok] == [200] * 8, ok
    baseline_s, states = wait_pools_baseline(dep, timeout=30)
    assert leaked_pages(states) == 0
    report("P killed", requests=len(outs), failed=len(failed),
           last_error_after_kill_s=round(max(o.t_end for o in failed) - t_kill, 2),
           all_answered_after_kill_s=round(t_all_answered, 2),
           p_state_at_kill={k: seen["p"][k] for k in ("num_waiting", "pd_registered_kv")},
           d_transfers_at_kill=seen["d"]["pd_transfers"], restart_s=round(restart_s, 2),
           reregistered_s=round(reregistered_s, 2), serving_again_after_kill_s=round(recovery_s, 2),
           serving_wait_s=round(serving_s, 2), pages_leaked=leaked_pages(states))


def test_decode_killed_mid_flight(dep):
    """kill -9 D while requests decode / wait for KV (and P holds requests of its own): the
    client gets an error, P releases the packed KV of the rooms the dead D had asked for when
    its connection closes (and of rooms no D ever asked for on expiry), D comes back and
    service resumes."""
    p_url, d_url = dep.url("prefill_0"), dep.url("decode_0")
    bg = Background([lambda i=i: post_generate(dep.proxy_url, long_request(i, 64))
                     for i in range(MID_FLIGHT_REQUESTS)], workers=MID_FLIGHT_REQUESTS)
    seen: dict = {}

    def mid_flight() -> bool:  # D holds requests (decoding or waiting for KV); P's state at
        seen["d"] = pool_state(d_url)  # that moment is reported, not required
        return seen["d"]["num_reqs"] > 0
    wait_mid_flight(mid_flight, bg, seen, "requests in flight at D")
    seen["p"] = pool_state(p_url)
    t_kill = time.monotonic()
    old = kill9(dep, "decode_0")
    outs = bg.result(timeout=120)
    failed = [o for o in outs if o.status != 200]
    assert failed, "killing D mid-flight failed no request"
    # The router answers a request whose D died only once P has answered it, so a request
    # still queued at P sees its error after P's backlog, not within kv_timeout: bounded, no hang.
    assert_clean_errors(outs, t_kill, deadline_s=60)

    # P's packed KV for D's rooms is released when D's side-channel connection closes (rooms
    # that no D asked for, e.g. retries while D was down, by the sender expiry).
    held = []

    def released() -> bool:
        held.append(pool_state(p_url)["pd_registered_kv"])
        return held[-1] == 0 and pool_state(p_url)["num_reqs"] == 0
    wait_until(released, SENDER_EXPIRY_S + 60, what="P released the dead D's rooms")
    released_s = time.monotonic() - t_kill
    assert health_generate_ok(p_url)
    restart_s = wait_restarted(dep, "decode_0", old)
    serving_s = wait_serving(dep.proxy_url, timeout=60)
    recovery_s = time.monotonic() - t_kill
    baseline_s, states = wait_pools_baseline(dep, timeout=30)
    assert leaked_pages(states) == 0
    report("D killed", requests=len(outs), failed=len(failed),
           last_error_after_kill_s=round(max(o.t_end for o in failed) - t_kill, 2),
           p_waiting_at_kill=seen["p"]["num_waiting"], d_reqs_at_kill=seen["d"]["num_reqs"],
           p_max_registered_after_kill=max(held),
           p_kv_released_after_kill_s=round(released_s, 2), restart_s=round(restart_s, 2),
           serving_again_after_kill_s=round(recovery_s, 2), serving_wait_s=round(serving_s, 2),
           pages_leaked=leaked_pages(states))


def test_bootstrap_restart_and_heartbeat_ttl(dep):
    """kill -9 the bootstrap server: P and D register again within one TTL of its restart and
    requests keep working throughout; a SIGSTOPped P drops out of /list after the TTL and comes
    back after SIGCONT."""
    def listed() -> set[str]:
        return {e["instance_id"] for e in bootstrap_list(dep)}

    wait_serving(dep.proxy_url, timeout=60)
    wait_pools_baseline(dep, timeout=30)
    assert listed() == {"prefill_0", "decode_0"}
    t_kill = time.monotonic()
    old = kill9(dep, "bootstrap")
    # requests keep working while the registry is down (D has P's checked registration cached)
    during = run_concurrently([lambda i=i: post_generate(dep.proxy_url, short_request(i))
                               for i in range(4)], workers=4)
    assert [o.status for o in during] == [200] * 4, during
    up_s = wait_restarted(dep, "bootstrap", old, timeout=60)
    t_up = time.monotonic()
    wait_until(lambda: listed() == {"prefill_0", "decode_0"}, TTL_S + 10, interval=0.1,
               what="P and D registered with the restarted bootstrap server")
    rereg_s = time.monotonic() - t_up
    assert rereg_s <= TTL_S + 2, f"re-registration took {rereg_s:.1f}s (TTL {TTL_S}s)"
    after = run_concurrently([lambda i=i: post_generate(dep.proxy_url, short_request(i))
                              for i in range(4)], workers=4)
    assert [o.status for o in after] == [200] * 4, after

    # A P whose heartbeats stop disappears after the TTL and returns when it runs again.
    p_pid = program_pid(dep, "prefill_0")
    os.kill(p_pid, signal.SIGSTOP)
    try:
        t_stop = time.monotonic()
        wait_until(lambda: "prefill_0" not in listed(), TTL_S + 10, interval=0.1,
                   what="stopped P dropped from /list")
        dropped_s = time.monotonic() - t_stop
        assert dropped_s >= TTL_S - 1.5, f"dropped after {dropped_s:.1f}s, before the TTL"
        assert "decode_0" in listed()
    finally:
        os.kill(p_pid, signal.SIGCONT)
    t_cont = time.monotonic()
    wait_until(lambda: "prefill_0" in listed(), TTL_S + 10, interval=0.1,
               what="resumed P registered again")
    back_s = time.monotonic() - t_cont
    serving_s = wait_serving(dep.proxy_url, timeout=60)
    baseline_s, states = wait_pools_baseline(dep, timeout=30)
    assert leaked_pages(states) == 0
    report("bootstrap killed / P stopped", bootstrap_restart_s=round(up_s, 2),
           reregistered_after_bootstrap_up_s=round(rereg_s, 2),
           total_after_kill_s=round(time.monotonic() - t_kill, 2),
           stopped_p_dropped_after_s=round(dropped_s, 2), resumed_p_listed_after_s=round(back_s, 2),
           serving_after_resume_s=round(serving_s, 2), pages_leaked=leaked_pages(states))


def test_leak_soak(dep):
    """1,000 requests mixing normal, client-aborted streams, failed prefill (rejected) and timed-
    out ones (a room no P serves, sent straight to D): pools, P's registered KV and the request
    tables return to baseline; P and D RSS stay flat."""
    p_url, d_url = dep.url("prefill_0"), dep.url("decode_0")
    p_proc = dep.process("prefill_0")
    p_zmq = f"{p_proc['address']}"
    rng = random.Random(7)

    def normal(i: int):
        return lambda: post_generate(dep.proxy_url, {
            "text": f"soak {i} " + "xy" * rng.randrange(1, 60),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, "normal")

    def aborted(i: int):
        return lambda: abort_stream(dep.proxy_url, {
            "text": f"abort {i} " + "z" * 40,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}})

    def bad(i: int):
        if i % 2:
            body = {"text": "too many tokens", "sampling_params": {"max_new_tokens": 5000}}
        else:
            body = {"text": "q" * 1100, "sampling_params": {"max_new_tokens": 4}}
        return lambda: post_generate(dep.proxy_url, body, "failed_prefill")

    def timed_out(i: int):
        body = {"text": f"orphan {i}", "sampling_params": {"max_new_tokens": 4},
                "bootstrap_host": p_zmq, "bootstrap_port": int(p_proc["ports"]["zmq"]),
                "bootstrap_room": rng.randrange(2**62)}
        return lambda: post_generate(d_url, body, "timed_out")

    # warm-up (first-use allocations are not leaks), then the RSS baseline
    run_concurrently([normal(-i) for i in range(1, 65)], workers=32)
    aborted(-1)()
    wait_pools_baseline(dep, timeout=30)
    p_pid, d_pid = program_pid(dep, "prefill_0"), program_pid(dep, "decode_0")
    rss_before = {"P": rss_mib(p_pid), "D": rss_mib(d_pid)}

    counts = {"normal": 700, "aborted": 120, "failed_prefill": 80, "timed_out": 100}
    makers = {"normal": normal, "aborted": aborted, "failed_prefill": bad, "timed_out": timed_out}
    jobs = [makers[k](i) for k, n in counts.items() for i in range(n)]
    rng.shuffle(jobs)
    health_codes: list[int] = []
    stop = threading.Event()

    def watch_health() -> None:
        while not stop.wait(1.0):
            for url in (p_url, d_url):
                try:
                    health_codes.append(httpx.get(f"{url}/health", timeout=10).status_code)
                except httpx.HTTPError:
                    health_codes.append(0)
    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        outs = run_concurrently(jobs, workers=48)
    finally:
        stop.set()
        watcher.join(15)
    soak_s = time.monotonic() - t0
    baseline_s, states = wait_pools_baseline(dep, timeout=KV_TIMEOUT_S + SENDER_EXPIRY_S + 20)
    rss_after = {"P": rss_mib(p_pid), "D": rss_mib(d_pid)}

    by_kind = collections.defaultdict(collections.Counter)
    for o in outs:
        by_kind[o.kind][o.status] += 1
    assert sum(sum(c.values()) for c in by_kind.values()) == 1000
    # Under overload (2 shared cores) a normal request may miss the 5 s KV timeout: that must be
    # a clean 5xx naming kv_timeout_s, never a hang, garbage or a leak; nearly all succeed.
    for o in outs:
        if o.kind == "normal" and o.status != 200:
            assert o.status is not None and o.status >= 500 and "kv_timeout_s" in o.body, o
    assert by_kind["normal"][200] >= 0.95 * counts["normal"], by_kind["normal"]
    assert by_kind["failed_prefill"] == {400: counts["failed_prefill"]}, by_kind["failed_prefill"]
    assert by_kind["timed_out"] == {504: counts["timed_out"]}, by_kind["timed_out"]
    assert sum(by_kind["aborted"].values()) == counts["aborted"]
    timeouts = [o for o in outs if o.kind == "timed_out"]
    assert all("kv_timeout_s" in o.body for o in timeouts), timeouts[:2]
    assert max(o.latency_s for o in timeouts) <= ERROR_DEADLINE_S
    assert health_codes and set(health_codes) == {200}, collections.Counter(health_codes)
    assert leaked_pages(states) == 0
    assert program_pid(dep, "prefill_0") == p_pid and program_pid(dep, "decode_0") == d_pid
    for role in ("P", "D"):  # flat: allocator caches may grow a little, a leak grows with load
        assert rss_after[role] <= rss_before[role] * 1.15 + 64, (rss_before, rss_after)
    report("leak soak", requests=1000, seconds=round(soak_s, 1),
           counts={k: dict(v) for k, v in by_kind.items()},
           baseline_after_s=round(baseline_s, 2), pages_leaked=leaked_pages(states),
           p_registered_kv=states["prefill_0"]["pd_registered_kv"],
           rss_mib_before={k: round(v) for k, v in rss_before.items()},
           rss_mib_after={k: round(v) for k, v in rss_after.items()})
