"""The launcher's readiness rules: a Rust router is ready only once it lists every worker; a
program that crash-loops, backs off or is FATAL during start-up ends the wait at once; a loading
server's progress (its /health 503 message) reaches the health table's rows."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate.health import (
    WorkerAnnouncer,
    loading_detail,
    router_workers_ready,
    wait_for_programs,
)
from pdtopo.launcher.operate.router_admin import RouterAdmin
from pdtopo.launcher.plan.expand import expand_plan


@pytest.fixture
def router():
    """A router registry: GET /workers lists `state["workers"]` with `state["status"]`; POST
    /workers records its body in `state["posted"]` (202) while the status is 200."""
    state = {"workers": [], "status": 200, "key": None, "posted": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            body = json.dumps({"workers": state["workers"], "total": len(state["workers"])})
            keyed = state["key"] and self.headers.get("Authorization") != f"Bearer {state['key']}"
            self.send_response(401 if keyed else state["status"])
            self.end_headers()
            self.wfile.write(body.encode())

        def do_POST(self):  # noqa: N802 - http.server API
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            up = state["status"] == 200
            if up:
                state["posted"].append(body)
            self.send_response(202 if up else state["status"])
            self.end_headers()
            self.wfile.write(b'{"status": "accepted"}')

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", state
    srv.shutdown()


def test_router_ready_only_when_all_workers_registered_and_healthy(router):
    url, state = router
    assert not router_workers_ready(url, 2)
    state["workers"] = [{"url": "p", "is_healthy": True}]
    assert not router_workers_ready(url, 2)
    state["workers"].append({"url": "d", "is_healthy": False})
    assert not router_workers_ready(url, 2)
    state["workers"][1]["is_healthy"] = True
    assert router_workers_ready(url, 2)


def test_router_without_worker_registry_is_ready(router):
    url, state = router
    state["status"] = 404  # MiniLB has no /workers
    assert router_workers_ready(url, 2)


def test_a_router_with_an_api_key_is_read_with_it(router):
    """A 401 is not "no registry": without the key the launcher would call a router ready
    before it had registered any worker."""
    url, state = router
    state["key"] = "k3y"
    assert not router_workers_ready(url, 1)
    assert not router_workers_ready(url, 1, api_key="k3y")  # no workers yet
    state["workers"] = [{"url": "p", "is_healthy": True}]
    assert not router_workers_ready(url, 1, api_key="wrong")
    assert router_workers_ready(url, 1, api_key="k3y")


def test_unreachable_router_is_not_ready():
    assert not router_workers_ready("http://127.0.0.1:9", 1, timeout=0.5)


# ------------------------------------------------------------------ start-up failures


def _plan():
    return expand_plan(compose_config(["model=tiny_llama", "topology=colocated_cpu"]), cpus=[0])


def _wait(sequence, timeout_s=180.0):
    """wait_for_programs over supervisord observations `sequence` (one per poll), with a
    fake clock of 0.5 s per poll; returns (result, polls taken)."""
    polls = iter(sequence)
    taken = []
    clock = iter(i * 0.5 for i in range(10_000))

    def states():
        taken.append(1)
        return next(polls)

    result = wait_for_programs(_plan(), states, timeout_s, poll_s=0, probe_fn=lambda _u: False,
                               clock=lambda: next(clock), workers_fn=None, detail_fn=None)
    return result, len(taken)


def test_crash_loop_after_startsecs_fails_the_wait_at_the_second_exit():
    # RUNNING past startsecs, exits, restarted (new pid), exits again: not a slow start
    seq = [{"colocated_0": s} for s in (("STARTING", 10), ("RUNNING", 10), ("RUNNING", 10),
                                        ("EXITED", 0), ("STARTING", 11), ("RUNNING", 11),
                                        ("RUNNING", 12), ("RUNNING", 12))]
    result, polls = _wait(seq)
    assert not result.ok and result.failed == "colocated_0"
    assert "exited 2 times" in result.reason and "crash loop" in result.reason
    assert polls == 7  # the restart between two polls (pid 11 -> 12) counts once


def test_fatal_fails_at_once_backoff_retries_and_a_slow_start_waits():
    result, polls = _wait([{"colocated_0": ("STARTING", 10)}, {"colocated_0": ("FATAL", 0)}])
    assert not result.ok and "is FATAL" in result.reason and polls == 2
    # exits before startsecs are supervisord's own retries (they end in FATAL), not run time
    retries = [{"colocated_0": s} for s in (("STARTING", 10), ("BACKOFF", 0), ("STARTING", 11),
                                            ("BACKOFF", 0), ("STARTING", 12), ("FATAL", 0))]
    result, polls = _wait(retries)
    assert not result.ok and "is FATAL" in result.reason and polls == 6
    slow = [{"colocated_0": ("RUNNING", 10)}] * 10
    result, polls = _wait(slow, timeout_s=3.0)
    assert not result.ok and "not healthy" in result.reason and polls == 7  # 3.5 s > 3 s


def test_a_loading_servers_progress_is_read_from_its_503(router):
    url, state = router
    assert loading_detail(url) == ""  # healthy: nothing to say
    state["status"] = 503
    assert loading_detail(url) == ""  # a 503 without pdtopo's error body
    assert loading_detail("http://127.0.0.1:9", timeout=0.5) == ""  # not answering yet

    class Loading(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            self.send_response(503)
            self.end_headers()
            self.wfile.write(json.dumps({"error": {
                "message": "engine is loading: compiled step shape 3/10"}}).encode())

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert loading_detail(f"http://127.0.0.1:{srv.server_address[1]}/health") == \
            "compiled step shape 3/10"
    finally:
        srv.shutdown()


def test_progress_is_shown_while_loading_and_cleared_once_healthy():
    said = iter(["loading weights 10/20 tensors", "", "compiled step shape 1/4"])
    healthy = iter([False, False, False, True])
    seen = []
    result = wait_for_programs(
        _plan(), lambda: {"colocated_0": ("RUNNING", 10)}, 60.0, poll_s=0,
        probe_fn=lambda _u: next(healthy), workers_fn=None,
        detail_fn=lambda _u: next(said), clock=iter(range(100)).__next__,
        on_update=lambda rows: seen.append([r.progress for r in rows]))
    assert result.ok
    # an empty answer (between two log lines) keeps the last progress shown
    assert seen == [["loading weights 10/20 tensors"], ["loading weights 10/20 tensors"],
                    ["compiled step shape 1/4"], [""]]


# ------------------------------------------------------------------ telling the router early


def test_healthy_servers_are_announced_to_the_router_until_it_takes_them():
    """A P or D leader is handed to `announce` from the first poll it is healthy on, again
    at every poll while that fails (router not answering), and never once it succeeded; the
    bootstrap server and the proxy are never announced."""
    plan = expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu"]), cpus=[0, 1])
    names = [p.name for p in plan.start_order()]
    assert {"prefill_0", "decode_0", "bootstrap", "proxy"} <= set(names)
    poll = iter(range(100))
    now = {"poll": 0}
    # the others at once, but the proxy: it is ready once it lists both servers
    healthy_from = {"prefill_0": 2, "decode_0": 4, "proxy": 6}
    calls = []

    def states():
        now["poll"] = next(poll)
        return {n: ("RUNNING", 10) for n in names}

    def probe(url):
        proc = next(p for p in plan.processes if p.health_url == url)
        return now["poll"] >= healthy_from.get(proc.name, 0)

    def announce(proc):
        calls.append((now["poll"], proc.name))
        return now["poll"] >= 5  # the router answers from poll 5 on

    listed = []  # the router's answers: both workers listed from poll 7 on

    def workers(base, expected):
        listed.append(now["poll"])
        return expected == 2 and now["poll"] >= 7

    result = wait_for_programs(plan, states, 60.0, poll_s=0, probe_fn=probe, workers_fn=workers,
                               detail_fn=None, clock=iter(range(100)).__next__,
                               announce=announce)
    assert result.ok
    assert [c for c in calls if c[1] == "prefill_0"] == [(i, "prefill_0") for i in (2, 3, 4, 5)]
    assert [c for c in calls if c[1] == "decode_0"] == [(4, "decode_0"), (5, "decode_0")]
    assert {name for _, name in calls} == {"prefill_0", "decode_0"}
    # the proxy is healthy only once the router lists the workers: the wait ended at poll 7
    assert listed == [6, 7] and now["poll"] == 7


def test_the_announcer_adds_an_unlisted_worker_once_and_waits_for_a_silent_router(router):
    url, state = router
    plan = expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu"]), cpus=[0, 1])
    p = next(x for x in plan.processes if x.role == "prefill")
    d = next(x for x in plan.processes if x.role == "decode")
    announce = WorkerAnnouncer(RouterAdmin(url))
    state["status"] = 503
    assert announce(p) is False and state["posted"] == []  # try again at the next poll
    state["status"] = 200
    assert announce(p) is True
    assert state["posted"] == [{"url": p.url, "worker_type": "prefill",
                                "bootstrap_port": p.ports["zmq"]}]
    state["workers"] = [{"url": d.url, "worker_type": "decode", "is_healthy": True}]
    assert announce(d) is True and len(state["posted"]) == 1  # the router has it already
