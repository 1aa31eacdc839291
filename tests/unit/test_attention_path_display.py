"""Where the attention path a server settled on shows (no compiling here; the fallback itself
runs in tests/e2e/test_attention_fallback.py): the label and the short reason, `attention` in
/pdtopo/state and `pdtopo:attention_info` in /metrics of the real app, and the launch table's
attention column, read once per server from its /pdtopo/state with the deployment token."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fastapi.testclient import TestClient
from rich.console import Console

from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate.display import health_table
from pdtopo.launcher.operate.health import attention_of, wait_for_programs
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.runtime.api.app import create_app
from pdtopo.runtime.api.state import ServerState
from pdtopo.runtime.engine.attention_fallback import (
    REASON_CHARS,
    AttentionPath,
    attention_label,
    refusal_error,
    short_reason,
)
from pdtopo.runtime.engine.scheduler import Scheduler
from tests.support.scheduler_fakes import FakeRunner, FakeTokenizer, make_ctx

MOSAIC = "Mosaic failed to compile TPU kernel: unsupported shape cast"
REFUSED = AttentionPath("gather", "auto", MOSAIC)


def test_labels_and_reasons():
    assert AttentionPath("pallas", "auto").label == "pallas"
    assert AttentionPath("gather", "gather").label == "gather"
    assert REFUSED.label == f"gather (pallas refused: {MOSAIC})"
    exc = RuntimeError(f"\n  INTERNAL:   {MOSAIC}\n\nThe MLIR operation involved:\n  %3 = ...")
    assert short_reason(exc) == f"INTERNAL: {MOSAIC}"  # the first line, whitespace collapsed
    long = short_reason(RuntimeError("x" * 1000))
    assert len(long) == REASON_CHARS and long.endswith("...")
    assert short_reason(NotImplementedError()) == "NotImplementedError"
    err = str(refusal_error("pallas", ("ragged", 8, 8, 4, 0), exc))
    assert err.startswith("engine.attention_impl=pallas: the TPU kernel (pdtopo ragged paged "
                          "attention) failed to compile for step shape ragged/8/8 (StepKey")
    assert "RuntimeError: INTERNAL: Mosaic failed" in err and "The MLIR operation" in err
    assert err.endswith("use engine.attention_impl=auto to fall back to the gather path, "
                        "or gather")
    assert attention_label([]) is None
    pallas = AttentionPath("pallas", "auto")
    assert attention_label([pallas, REFUSED, pallas]) == f"pallas; {REFUSED.label}"


def test_state_and_metrics_show_the_fallback():
    ctx = make_ctx()
    runner = FakeRunner()
    runner.attention_path = lambda: REFUSED
    state = ServerState(ctx)
    state.scheduler = Scheduler(ctx, runner, FakeTokenizer(), metrics=state.metrics)
    state.runner, state.ready = runner, True
    state.metrics.set_attention([AttentionPath("pallas", "auto")])  # replaced, not added
    state.metrics.set_attention(state.scheduler.attention_paths())  # as server.load_engine
    with TestClient(create_app(state)) as client:
        st = client.get("/pdtopo/state").json()
        metrics = client.get("/metrics").text
    assert st["attention"] == f"gather (pallas refused: {MOSAIC})"
    lines = [ln for ln in metrics.splitlines() if ln.startswith("pdtopo:attention_info{")]
    assert lines == [f'pdtopo:attention_info{{fallback_reason="{MOSAIC}",impl="gather",'
                     'requested="auto"} 1.0']
    # a runner that does not say (a fake): no label, nothing breaks
    plain = Scheduler(ctx, FakeRunner(), FakeTokenizer())
    assert plain.stats()["attention"] is None and plain.attention_paths() == []


def test_the_launch_table_shows_each_servers_attention():
    token = "deployment-token"
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            seen.append(self.path)
            ok = self.headers.get("Authorization") == f"Bearer {token}"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(json.dumps({"attention": REFUSED.label} if ok else {}).encode())

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        health = f"http://127.0.0.1:{srv.server_address[1]}/health"
        assert attention_of(health, token) == REFUSED.label and seen == ["/pdtopo/state"]
        assert attention_of(health, "wrong") == ""
    finally:
        srv.shutdown()
    assert attention_of("http://127.0.0.1:9/health", token, timeout=0.5) == ""

    plan = expand_plan(compose_config(["model=tiny_llama", "topology=1p1d_cpu"]), cpus=[0, 1])
    names = [p.name for p in plan.start_order()]
    asked = []

    def attention(url):
        asked.append(url)
        return "pallas" if "prefill" in next(p.name for p in plan.processes
                                             if p.health_url == url) else REFUSED.label

    result = wait_for_programs(plan, lambda: {n: ("RUNNING", 10) for n in names}, 60.0,
                               poll_s=0, probe_fn=lambda _u: True, workers_fn=None,
                               detail_fn=None, attention_fn=attention)
    assert result.ok
    rows = {r.name: r for r in result.rows}
    assert rows["prefill_0"].attention == "pallas"
    assert rows["decode_0"].attention == REFUSED.label
    assert rows["bootstrap"].attention == rows["proxy"].attention == ""  # not servers
    assert len(asked) == 2  # once per server, when it turned healthy
    con = Console(record=True, width=400)
    con.print(health_table(plan, result.rows))
    text = con.export_text()
    assert "attention" in text and f"gather (pallas refused: {MOSAIC})" in text
    con = Console(record=True, width=400)
    con.print(health_table(plan, [r for r in result.rows if not r.attention]))
    assert "attention" not in con.export_text()  # no server said yet: no column
