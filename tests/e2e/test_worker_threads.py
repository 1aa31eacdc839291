"""A dead worker thread never leaves a serving process looking healthy (issue 30, item 3).

Every long-lived thread of a P / D / colocated server runs as a `WorkerThread`
(pdtopo.runtime.worker_threads): its death calls `on_crash`, which in a server ends the process
(status 70; supervisord restarts it, the router drops it). Here each thread is killed in-process
through the config knob's injector (`server.fault_inject_thread`) with a recording `on_crash`:
the scheduler loop (also by a real exception escaping its crash handler: /health's `alive` turns
false), the side-channel I/O thread, the transfer engine's sweep thread, the bootstrap keeper
and the lockstep control thread. One real server process shows the whole path: the scheduler
thread dies at its first batch, /health stops answering 200 and the process exits within 5 s.
A dp deployment (two colocated instances behind sglang-router, supervisord) shows the rest: the
router stops choosing the dead instance, the survivor serves, the replacement rejoins.
A second dp deployment does the same for an engine step that fails after its KV pool was
donated (`engine.fault_inject_step_error_after`, issue 45 item 2): the requests in flight on
that instance are answered 503 before it exits (status 70); tests/unit/test_step_errors.py has
the scheduler-level cases (fatal vs. per-request errors).
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.ports import free_port
from pdtopo.runtime.bootstrap.client import RegistrationKeeper
from pdtopo.runtime.bootstrap.protocol import Registration
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.side_channel import SideChannel
from pdtopo.runtime.distributed.control import ControlServer
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.settings import direct_process_context
from pdtopo.runtime.worker_threads import CRASH_EXIT_CODE, FaultInjector, InjectedCrash
from tests.support.constants import ONE_DEVICE, TINY_OVERRIDES
from tests.support.e2e import ColocatedServer
from tests.support.faults import wait_until
from tests.support.scheduler_fakes import FakeRunner, FakeTokenizer, make_ctx

EXIT_WITHIN_S = 5.0


class Crashes:
    """A recording `on_crash`: (thread name, exception) of every reported death."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, BaseException]] = []
        self._event = threading.Event()

    def __call__(self, name: str, exc: BaseException) -> None:
        self.seen.append((name, exc))
        self._event.set()

    def wait(self, timeout: float = EXIT_WITHIN_S) -> tuple[str, BaseException]:
        assert self._event.wait(timeout), "no thread death was reported"
        return self.seen[0]


def armed(kind: str, after: int = 1) -> FaultInjector:
    return FaultInjector(kind, kind, after, setting="server.fault_inject_thread")


def request(rid: str, n: int = 8) -> Req:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return Req(rid=rid, prompt_ids=[3, 4, 5], sampling=sp, sink=QueueSink())


class BrokenFinish(Scheduler):
    """A scheduler whose crash handler itself fails (finish_request raises)."""

    def finish_request(self, req, reason):
        raise RuntimeError("finish_request is broken")


def test_an_error_escaping_the_scheduler_crash_handler_reports_the_dead_loop():
    s = BrokenFinish(make_ctx(), FakeRunner(64, 4, fail_on=5), FakeTokenizer())
    crashes = Crashes()
    s.on_crash = crashes
    s.start()
    s.submit(request("r1"))  # its forward fails; failing it fails too: the loop dies
    name, exc = crashes.wait()
    assert name == "scheduler" and "finish_request is broken" in str(exc)
    assert s.alive is False and s.stats()["alive"] is False  # /health answers 503
    s._thread.join(1)
    assert not s._thread.is_alive()


def test_scheduler_fault_knob_kills_the_loop_at_its_nth_batch():
    cfg = OmegaConf.merge(
        compose_config(["model=tiny_llama", "server.fault_inject_thread=scheduler",
                        "server.fault_inject_after_steps=3"]),
        {"engine": {"max_model_len": 64, "max_prefill_tokens": 32}, "model": {"name": "fake"}})
    s = Scheduler(direct_process_context(cfg), FakeRunner(64, 4), FakeTokenizer())
    crashes = Crashes()
    s.on_crash = crashes
    s.start()
    r = request("r1", n=20)
    s.submit(r)
    name, exc = crashes.wait()
    assert name == "scheduler" and isinstance(exc, InjectedCrash)
    assert "server.fault_inject_thread=scheduler" in str(exc)
    assert len(r.output_ids) == 2  # the prefill's token and one decode step, then the third
    assert s.alive is False


def test_side_channel_io_thread_death_is_reported():
    crashes = Crashes()
    p = SideChannel(bind="127.0.0.1:0", name="p", on_crash=crashes, fault=armed("side_channel"))
    d = SideChannel(bind=None, name="d")
    try:
        time.sleep(0.3)
        assert not crashes.seen and p.alive  # an idle channel is not a busy step
        d.send_to(p.address, m.Want(room=1))
        name, exc = crashes.wait()
        assert name == "p-io" and isinstance(exc, InjectedCrash)
        p._thread.join(1)
        assert not p.alive
    finally:
        d.close()
        p.close()


def test_transfer_engine_sweep_thread_death_is_reported():
    import jax

    from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine

    crashes = Crashes()
    e = JaxTransferKVEngine(transfer_sockets=1, pull_workers=1, sweep_interval_s=0.05,
                            on_crash=crashes, fault=armed("kv_sweep"))
    try:
        time.sleep(0.3)
        assert not crashes.seen  # sweeps with nothing registered are not busy steps
        e.register(1, [jax.device_put(np.zeros((4,), np.float32))], expire_s=30)
        name, exc = crashes.wait()
        assert name == "kv-engine-sweep" and isinstance(exc, InjectedCrash)
    finally:
        e.close()


class FakeBootstrap:
    url = "http://bootstrap.invalid"

    def __init__(self) -> None:
        self.heartbeats = 0

    def register(self, reg) -> dict:
        return {}

    def heartbeat(self, hb) -> bool:
        self.heartbeats += 1
        return True


def test_bootstrap_keeper_death_is_reported():
    reg = Registration(role="prefill", instance_id="p0", tp_rank=0, tp_size=1,
                       transfer_addr="127.0.0.1:1", zmq_addr="127.0.0.1:2", page_size=8,
                       kv_dtype="float32", model="m")
    client, crashes = FakeBootstrap(), Crashes()
    keeper = RegistrationKeeper(client, reg, interval_s=0.05, on_crash=crashes,
                                fault=armed("bootstrap_keeper", after=3)).start()
    try:
        assert keeper.wait_registered(5)
        name, exc = crashes.wait()
        assert name == "bootstrap-keeper" and isinstance(exc, InjectedCrash)
        assert client.heartbeats == 3
    finally:
        keeper.stop()


def test_lockstep_control_thread_death_is_reported():
    crashes = Crashes()
    server = ControlServer(f"127.0.0.1:{free_port()}", 0, on_crash=crashes,
                           fault=armed("lockstep_control"))
    try:
        server.broadcast({"op": "forward"})
        name, exc = crashes.wait()
        assert name == "lockstep-control" and isinstance(exc, InjectedCrash)
    finally:
        server.close()


@pytest.mark.slow
def test_server_whose_scheduler_thread_dies_exits_within_5s(tmp_path):
    """A real colocated server with server.fault_inject_thread=scheduler: healthy until its
    first batch, then its loop dies; /health never answers 200 again and the process exits
    with status 70 within 5 s (supervisord would restart it)."""
    srv = ColocatedServer(None, [*TINY_OVERRIDES, "server.fault_inject_thread=scheduler"],
                          tmp_path / "server.log", env=ONE_DEVICE)
    srv.start()
    try:
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        t0 = time.monotonic()
        try:
            httpx.post(f"{srv.url}/generate", json={"text": "hi"}, timeout=10)
        except httpx.HTTPError:
            pass  # the process may be gone before it answers
        codes = []
        while srv.proc.poll() is None and time.monotonic() - t0 < EXIT_WITHIN_S + 5:
            try:
                codes.append(httpx.get(f"{srv.url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                codes.append(0)  # refused: the process is gone
            time.sleep(0.05)
        took = time.monotonic() - t0
        print(f"\n[reliability] scheduler thread death -> exit {took:.2f} s after the request")
        assert srv.proc.poll() == CRASH_EXIT_CODE, srv.log_tail()
        assert took < EXIT_WITHIN_S, took
        assert 200 not in codes, codes
        assert "worker thread scheduler crashed" in srv.log_tail(20000)
    finally:
        srv.stop()


# ------------------------------------------------------------------ behind the router (dp)
DP_FAULT_AFTER = 30  # the scheduler thread of every instance dies at its 30th batch
DP_OVERRIDES = [
    "topology=colocated_cpu", "topology.mode=dp", "topology.colocated.instances=2",
    "topology.accelerator=cpu-2", *TINY_OVERRIDES,
    "server.fault_inject_thread=scheduler", f"server.fault_inject_after_steps={DP_FAULT_AFTER}",
    # retries off: the router would otherwise resend the killing request to the survivor
    # (which would then reach its own 30th batch); every client sees its own request's fate
    "proxy.retries=0", "proxy.health_check_interval_s=1", "proxy.request_timeout_s=60",
]


def short(url: str) -> httpx.Response:
    """A two-batch request (its prefill and one decode step)."""
    return httpx.post(f"{url}/generate", timeout=30, json={
        "text": "short", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def generated(url: str) -> int:
    return httpx.get(f"{url}/pdtopo/state", timeout=5).json()["num_generated"]


@pytest.mark.slow
def survivor_takes_over(dep, router, urls: dict, dead: str, alive: str, n: int) -> float:
    """Wait for the router to mark `dead` unhealthy (returns when, monotonic), then `n` short
    requests through the proxy are all served, all by `alive`."""
    wait_until(lambda: router.health(urls[dead]) is not True, 10, interval=0.05,
               what=f"the router marking {dead} unhealthy")
    marked = time.monotonic()
    served = generated(urls[alive])
    answers = [short(dep.proxy_url) for _ in range(n)]
    assert [a.status_code for a in answers] == [200] * n, [a.text[:200] for a in answers]
    assert generated(urls[alive]) - served == n * 2  # all on the survivor
    return marked


def test_router_stops_routing_to_an_instance_whose_scheduler_thread_died(tmp_path):
    """dp: two colocated instances behind sglang-router, each armed to lose its scheduler
    thread at its 30th batch. One long request kills the instance serving it: its client gets
    an error at once, that instance's /health stops answering 200 and its process exits
    (status 70) within 5 s, the router marks it unhealthy, short requests meanwhile all succeed
    on the survivor, and supervisord's replacement rejoins the router."""
    from pdtopo.launcher.operate.router_admin import RouterAdmin
    from pdtopo.launcher.operate.supervisor_control import pid_alive
    from tests.support.e2e import Deployment, deployment_overrides, port_block
    from tests.support.faults import program_pid, wait_restarted

    dep = Deployment(tmp_path / "run", [*DP_OVERRIDES, *deployment_overrides(port_block(40))])
    dep.launch()
    try:
        names = dep.names("colocated")
        urls = {n: dep.url(n) for n in names}
        pids = {n: program_pid(dep, n) for n in names}
        router = RouterAdmin(dep.proxy_url)
        assert all(router.health(u) for u in urls.values()), router.workers()
        t0 = time.monotonic()
        try:
            r = httpx.post(f"{dep.proxy_url}/generate", timeout=30, json={
                "text": "long", "sampling_params": {"max_new_tokens": 3 * DP_FAULT_AFTER,
                                                    "temperature": 0, "ignore_eos": True}})
            answer = f"HTTP {r.status_code}: {r.text[:200]}"
            assert r.status_code >= 500, answer
        except httpx.HTTPError as exc:  # the connection dropped with the process
            answer = repr(exc)
        client_s = time.monotonic() - t0

        def one_dead() -> list[str]:
            return [n for n in names if not healthy(urls[n])]
        wait_until(one_dead, EXIT_WITHIN_S, interval=0.05, what="one /health != 200")
        unhealthy_s = time.monotonic() - t0
        (dead,) = one_dead()
        (alive,) = [n for n in names if n != dead]
        wait_until(lambda: not pid_alive(pids[dead]), EXIT_WITHIN_S, interval=0.05,
                   what=f"{dead}'s pid {pids[dead]} gone")
        exit_s = time.monotonic() - t0
        assert exit_s < EXIT_WITHIN_S, exit_s
        sup_log = (dep.run_dir / "supervisord.log").read_text()
        assert f"exited: {dead} (exit status {CRASH_EXIT_CODE}; not expected)" in sup_log, \
            sup_log[-2000:]
        out_s = survivor_takes_over(dep, router, urls, dead, alive, 5) - t0
        assert not healthy(urls[dead]), f"{dead} came back before the check ended"
        back_s = wait_restarted(dep, dead, pids[dead], timeout=120)
        wait_until(lambda: router.health(urls[dead]) is True, 30, what=f"{dead} back in router")
        before = {n: generated(u) for n, u in urls.items()}
        answers = [short(dep.proxy_url) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
        assert all(generated(u) > before[n] for n, u in urls.items()), "not both serving again"
        print(f"\n[reliability] dp scheduler thread death, seconds after the killing request "
              f"was sent: client error {client_s:.2f} ({answer[:60]}); /health not 200 "
              f"{unhealthy_s:.2f}; process exited {exit_s:.2f}; router lists it unhealthy "
              f"{out_s:.2f}; then 5/5 short requests served by {alive}; {dead} restarted and "
              f"healthy {back_s:.1f} s after the exit check")
    except BaseException:
        print(dep.log_tails())
        raise
    finally:
        dep.stop_and_check()


# ------------------------------------------------------------------ a step that loses the pool
STEP_FAULT_AT = 400  # every instance's scheduler fails its 400th step after donating its pool
LONG_TOKENS = 700    # the requests in flight then are far from done
STEP_FAULT_OVERRIDES = [
    "topology=colocated_cpu", "topology.mode=dp", "topology.colocated.instances=2",
    "topology.accelerator=cpu-2", *TINY_OVERRIDES, "engine.num_pages=400",  # 4 x 700 tokens
    f"engine.fault_inject_step_error_after={STEP_FAULT_AT}",
    "proxy.retries=0", "proxy.health_check_interval_s=1", "proxy.request_timeout_s=60",
]


@pytest.mark.slow
def test_a_step_that_loses_the_kv_pool_restarts_its_server(tmp_path):
    """dp, two colocated instances behind sglang-router, each armed to fail its 400th step
    after donating its KV pool (`engine.fault_inject_step_error_after`). Four long requests in
    flight on one instance: that step fails; every one of them is answered 503 (retryable,
    naming the error) before the process exits with status 70, its /health answers 503 (never
    200) until then, the router marks it unhealthy, the survivor serves, and supervisord's
    replacement serves again. Before the fix the server kept /health 200 and failed every later
    step on the deleted pool."""
    from pdtopo.launcher.operate.router_admin import RouterAdmin
    from pdtopo.launcher.operate.supervisor_control import pid_alive
    from tests.support.e2e import Deployment, deployment_overrides, port_block
    from tests.support.faults import (
        Background,
        post_generate,
        program_pid,
        wait_restarted,
    )

    dep = Deployment(tmp_path / "run",
                     [*STEP_FAULT_OVERRIDES, *deployment_overrides(port_block(40))])
    dep.launch()
    try:
        names = dep.names("colocated")
        urls = {n: dep.url(n) for n in names}
        dead, alive = names
        pid = program_pid(dep, dead)
        router = RouterAdmin(dep.proxy_url)
        assert all(router.health(u) for u in urls.values()), router.workers()
        long = {"text": "long", "sampling_params": {"max_new_tokens": LONG_TOKENS,
                                                    "temperature": 0, "ignore_eos": True}}
        t0 = time.monotonic()
        flight = Background([lambda: post_generate(urls[dead], long, timeout=60)] * 4)
        codes: list[tuple[float, int]] = []  # (when, /health status; 0: refused)
        while pid_alive(pid) and time.monotonic() - t0 < 60:
            try:
                codes.append((time.monotonic(), httpx.get(f"{urls[dead]}/health",
                                                          timeout=1).status_code))
            except httpx.HTTPError:
                codes.append((time.monotonic(), 0))
            time.sleep(0.02)
        exited = time.monotonic()
        assert not pid_alive(pid), f"{dead} still runs {exited - t0:.0f} s after the requests"
        outcomes = flight.result(timeout=10)  # none hangs
        for o in outcomes:
            assert o.status == 503, (o.status, o.body)
            assert "injected failure of step" in o.body and "retry" in o.body, o.body
            assert o.t_end <= exited + 0.5, (o.t_end - exited, o.body)
        first_503 = next((t for t, c in codes if c == 503), None)  # /health 503 before
        assert first_503 is not None, codes[-20:]                   # the exit ...
        assert all(c != 200 for t, c in codes if t >= first_503), codes  # ... never 200 again
        line = f"exited: {dead} (exit status {CRASH_EXIT_CODE}; not expected)"
        wait_until(lambda: line in (dep.run_dir / "supervisord.log").read_text(), 5,
                   what=f"supervisord logging {line!r}")
        log = (dep.run_dir / "logs" / f"{dead}.log").read_text()
        assert "device state is lost" in log and "worker thread scheduler crashed" in log
        out_s = survivor_takes_over(dep, router, urls, dead, alive, 3) - exited
        back_s = wait_restarted(dep, dead, pid, timeout=120)
        wait_until(lambda: router.health(urls[dead]) is True, 30, what=f"{dead} back in router")
        assert short(urls[dead]).status_code == 200  # the replacement serves
        answers = [short(dep.proxy_url) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
        print(f"\n[reliability] step failure after donation, seconds after the 4 requests were "
              f"sent: answered 503 at {max(o.t_end for o in outcomes) - t0:.2f}, process "
              f"exited (status {CRASH_EXIT_CODE}) at {exited - t0:.2f}, /health 503 from "
              f"{first_503 - t0:.2f}; router lists it unhealthy {out_s:.2f} s after the exit; "
              f"replacement healthy {back_s:.1f} s after that check")
    except BaseException:
        print(dep.log_tails())
        raise
    finally:
        dep.stop_and_check()
