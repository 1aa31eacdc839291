"""The planner program's loop (pdtopo/launcher/programs/planner.py) with a fake clock, fake
observations and a fake `pdtopo scale`: what it decides, carries out, logs and publishes
interval by interval; hysteresis under a load at a threshold (no flapping); the pause (a scale
by hand, `pdtopo planner pause`) and resume; a failed change backing it off; a restarted
planner carrying on; recommend mode never acting. Also the pieces on their own: /metrics
scraping, the pdtopo:planner_* text, the scale lock, `pdtopo scale`'s guard and a real child
`pdtopo scale`. The real-process run is tests/e2e/test_planner_e2e.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate import planner_cli
from pdtopo.launcher.operate import planner_files as files
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.launcher.programs import planner_io
from pdtopo.launcher.programs.planner import PlannerLoop
from pdtopo.launcher.programs.planner_io import (
    SavedState,
    ScaleActor,
    Scraper,
    load_state,
    metrics_text,
)
from pdtopo.planner.budget import Budget, Counts
from pdtopo.planner.capacity import InstanceProfile
from pdtopo.planner.decide import Decision, PlannerState
from pdtopo.planner.observe import InstanceObservation, Observation
from pdtopo.planner.settings import PlannerSettings

INTERVAL = 5.0
# one P: 1000 prompt tok/s flat out (900 counted: no TTFT limit), one D: 100 tok/s (90)
PROFILE = InstanceProfile(prefill_tps=1000, decode_tps=((1, 100.0),), max_batch=8)
P_CAP, D_CAP = 900.0, 90.0
_PLANS: dict[Counts, str] = {}


def settings(**values) -> PlannerSettings:
    base = {"enabled": True, "interval_s": INTERVAL,
            "slo": {"ttft_ms": None, "itl_ms": None, "percentile": 90},
            "hysteresis": {"min_change_interval_s": 10, "margin": 0.1, "backoff_s": 30},
            "capacity": {"source": "profile", "profile": "profile.json"}}
    for key, value in values.items():
        base[key] = value
    return PlannerSettings.with_defaults(base)


def plan_json(counts: Counts) -> str:
    if counts not in _PLANS:
        cfg = compose_config(["model=tiny_llama", "topology.accelerator=cpu-3",
                              f"topology.prefill.instances={counts.prefill}",
                              f"topology.decode.instances={counts.decode}"])
        _PLANS[counts] = expand_plan(cfg, run_dir="/run", python="py", cpus=[0, 1]).to_json()
    return _PLANS[counts]


class Load:
    """The fake observation: prompt and decode tokens/s spread over the instances."""

    def __init__(self) -> None:
        self.prompt = 0.0
        self.decode = 0.0
        self.errors: dict[str, str] = {}

    def observe(self, leaders, now: float) -> Observation:
        ps = [p for p in leaders if p.role == "prefill"]
        ds = [p for p in leaders if p.role == "decode"]
        inst = [InstanceObservation(p.name, "prefill", 0.0, None, self.prompt / len(ps), 0.0,
                                    self.prompt / len(ps) / 500, 0.0) for p in ps]
        inst += [InstanceObservation(d.name, "decode", 0.0, None, 0.0, self.decode / len(ds),
                                     self.decode / len(ds) / 50, 4.0) for d in ds]
        return Observation(now, INTERVAL, tuple(inst))


class FakeScale:
    """`pdtopo scale` that reaches its target at once (plan.json rewritten as the real one
    does) and reports after `polls` polls; `ok=False`: it fails and changes nothing."""

    def __init__(self, run_dir: Path, ok: bool = True, polls: int = 1,
                 write_at_end: bool = False) -> None:
        self.run_dir = run_dir
        self.ok = ok
        self.polls = polls
        self.write_at_end = write_at_end  # plan.json rewritten just before it exits
        self.target: Counts | None = None
        self.started: list[tuple[str, Counts, Counts]] = []
        self.left: int | None = None

    def start(self, decision: Decision, current: Counts) -> int:
        self.started.append((decision.label, current, decision.target))
        self.target = decision.target
        if self.ok and not self.write_at_end:
            write_plan(self.run_dir, decision.target)
        self.left = self.polls
        return 4242

    def adopt(self, pid, target) -> None:
        self.left = 0

    def poll(self, counts) -> bool | None:
        if self.left is None:
            return None
        if self.left > 0:
            self.left -= 1
            return None
        self.left = None
        if self.ok and self.write_at_end:
            write_plan(self.run_dir, self.target)
        return self.ok

    @property
    def busy(self) -> bool:
        return self.left is not None

    def clear(self) -> None:
        self.left = None


def write_plan(run_dir: Path, counts: Counts) -> None:
    files.write_atomic(run_dir / "plan.json", plan_json(counts))


def make_loop(run_dir: Path, counts: Counts = Counts(1, 1), chips: int = 3, ok: bool = True,
              **values) -> tuple[PlannerLoop, Load, FakeScale]:
    write_plan(run_dir, counts)
    (run_dir / "config.yaml").write_text("planner: {enabled: true, mode: "
                                         f"{values.get('mode', 'act')}}}\n")
    load, scale = Load(), FakeScale(run_dir, ok)
    loop = PlannerLoop(run_dir, settings(**values), Budget(chips=chips), PROFILE,
                       scraper=load, actor=scale)  # type: ignore[arg-type]
    return loop, load, scale


def counts_now(run_dir: Path) -> Counts:
    plan = json.loads((run_dir / "plan.json").read_text())
    roles = [p["role"] for p in plan["processes"]]
    return Counts(roles.count("prefill"), roles.count("decode"))


def run_ticks(loop: PlannerLoop, t0: float, n: int) -> tuple[float, list[dict]]:
    records = []
    t = t0
    for _ in range(n):
        t += INTERVAL
        rec = loop.tick(t)
        if rec:
            records.append(rec)
    return t, records


@pytest.mark.parametrize("write_at_end", [False, True])
def test_the_phases_scale_out_role_change_scale_in(tmp_path, write_at_end):
    """`write_at_end`: the scale rewrites plan.json just before it exits (a scale in does),
    which must not read as a change by hand."""
    loop, load, scale = make_loop(tmp_path)
    scale.write_at_end = write_at_end
    load.prompt, load.decode = 3 * P_CAP, 0.2 * D_CAP  # prompt-heavy
    t, recs = run_ticks(loop, 1000.0, 1)
    assert recs[0]["label"] == "scale_out(prefill)" and recs[0]["acted"]
    assert scale.started == [("scale_out(prefill)", Counts(1, 1), Counts(2, 1))]
    t, recs = run_ticks(loop, t, 3)  # the change ends; the budget (3) is full
    assert counts_now(tmp_path) == Counts(2, 1)
    assert [r["action"] for r in recs] == ["none"] * 3
    assert "under way" in recs[0]["reason"]
    assert "3 chips" in recs[-1]["reason"] or "budget" in recs[-1]["reason"]
    load.prompt, load.decode = 0.2 * P_CAP, 3 * D_CAP  # decode-heavy: a P moves to D
    t, recs = run_ticks(loop, t, 1)
    assert recs[0]["label"] == "role_change(prefill->decode)" and recs[0]["acted"]
    assert scale.started[-1][1:] == (Counts(2, 1), Counts(1, 2))
    t, _ = run_ticks(loop, t, 2)
    assert counts_now(tmp_path) == Counts(1, 2)
    load.prompt, load.decode = 0.1 * P_CAP, 0.1 * D_CAP  # the load drops: a D goes
    t, recs = run_ticks(loop, t, 12)
    ins = [r for r in recs if r["acted"]]
    assert [r["label"] for r in ins] == ["scale_in(decode)"], [r["reason"] for r in recs]
    assert counts_now(tmp_path) == Counts(1, 1)
    # every decision and outcome is one JSON line of RUN/planner.log
    lines = files.read_lines(tmp_path)
    outcomes = [r for r in lines if r["event"] == "outcome"]
    assert [(r["label"], r["ok"]) for r in outcomes] == [
        ("scale_out(prefill)", True), ("role_change(prefill->decode)", True),
        ("scale_in(decode)", True)]
    decisions = [r for r in lines if r["event"] == "decision"]
    assert all("observation" in r and "load" in r and "capacity" in r for r in decisions)
    status = files.read_status(tmp_path)
    assert status["counts"] == {"prefill": 1, "decode": 1} and status["paused"] is None
    assert files.paused(tmp_path) is None
    assert status["outcomes"] == {"ok": 3}
    assert status["decisions"]["scale_out"] == 1 and status["decisions"]["role_change"] == 1
    line = files.summary(status)
    assert line.startswith("planner (act, every 5 s): 1P1D; last decision") and \
        "last change scale_in(decode) done" in line


@pytest.mark.parametrize("n,level", [(1, 1.1), (2, 0.9)])
def test_a_load_at_a_threshold_does_not_flap(tmp_path, n, level):
    """A prompt load wandering +-8 % around the scale-out threshold (1P: 1.1 instances'
    worth) or the scale-in threshold (2P: 0.9), for 60 intervals: at most one change."""
    loop, load, scale = make_loop(tmp_path, Counts(n, 1), chips=4)
    t = 1000.0
    for i in range(60):
        load.prompt = level * P_CAP * (1 + 0.08 * (1 if i % 3 == 0 else -1 if i % 3 == 1
                                                   else 0.5))
        load.decode = 0.3 * D_CAP
        t, _ = run_ticks(loop, t, 1)
    assert len(scale.started) <= 1, scale.started
    shapes = {(p, d) for _label, p, d in scale.started}
    assert len(shapes) <= 1


def test_recommend_mode_decides_and_logs_but_never_acts(tmp_path):
    loop, load, scale = make_loop(tmp_path, mode="recommend")
    load.prompt = 5 * P_CAP
    _, recs = run_ticks(loop, 1000.0, 4)
    assert [r["label"] for r in recs] == ["scale_out(prefill)"] * 4
    assert not any(r["act"] or r["acted"] for r in recs)
    assert scale.started == [] and counts_now(tmp_path) == Counts(1, 1)
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(
                   (tmp_path / files.METRICS_FILE).read_text()) for s in f.samples}
    assert metrics[("pdtopo:planner_decisions_total", (("action", "scale_out"),))] == 4
    assert metrics[("pdtopo:planner_target_instances", (("role", "prefill"),))] == 2
    assert metrics[("pdtopo:planner_current_instances", (("role", "prefill"),))] == 1
    load_p = metrics[("pdtopo:planner_estimated_load_tokens_per_second",
                      (("role", "prefill"),))]
    assert load_p == pytest.approx(5 * P_CAP)


def test_a_scale_by_hand_pauses_it_until_resume(tmp_path):
    loop, load, scale = make_loop(tmp_path)
    load.prompt = 0.3 * P_CAP
    t, _ = run_ticks(loop, 1000.0, 2)
    write_plan(tmp_path, Counts(1, 2))  # `pdtopo scale decode=2` by someone else
    load.prompt, load.decode = 3 * P_CAP, 0.1 * D_CAP
    t, recs = run_ticks(loop, t, 3)
    assert recs[0]["paused"].startswith("the deployment went from 1P1D to 1P2D")
    assert files.paused(tmp_path) is not None
    assert all(not r["acted"] and r["not_acted"].startswith("paused") for r in recs)
    assert scale.started == []
    assert "PAUSED" in files.summary(files.read_status(tmp_path), files.paused(tmp_path))
    assert files.resume(tmp_path).startswith("the deployment went")
    t, recs = run_ticks(loop, t, 1)
    assert recs[0]["acted"] and recs[0]["label"] == "role_change(decode->prefill)"


def test_the_pause_file_and_a_scale_under_way_hold_it(tmp_path):
    loop, load, scale = make_loop(tmp_path)
    files.pause(tmp_path, "`pdtopo planner pause`")
    load.prompt = 3 * P_CAP
    t, recs = run_ticks(loop, 1000.0, 1)
    assert recs[0]["not_acted"].startswith("paused: `pdtopo planner pause`")
    files.resume(tmp_path)
    with files.scale_lock(tmp_path, "by hand `pdtopo scale decode=2`", print):
        t, recs = run_ticks(loop, t, 1)
    assert recs[0]["not_acted"].startswith("a scale is under way (by hand `pdtopo scale")
    assert scale.started == []


def test_a_failed_change_backs_off_and_is_counted(tmp_path):
    loop, load, scale = make_loop(tmp_path, ok=False)
    load.prompt = 3 * P_CAP
    t, recs = run_ticks(loop, 1000.0, 3)
    assert recs[0]["acted"]
    assert "backing off for 30 s after 1 failed" in recs[-1]["reason"]
    assert files.read_status(tmp_path)["outcomes"] == {"failed": 1}
    assert counts_now(tmp_path) == Counts(1, 1)  # the scale's roll-back left it as it was
    t, recs = run_ticks(loop, t, 6)  # 30 s later it tries again
    assert sum(r["acted"] for r in recs) == 1 and len(scale.started) == 2
    assert "planner (act" in files.summary(files.read_status(tmp_path))


def test_a_restarted_planner_carries_on(tmp_path):
    loop, load, scale = make_loop(tmp_path)
    scale.polls = 100  # the change is still running when the planner dies
    load.prompt = 3 * P_CAP
    t, recs = run_ticks(loop, 1000.0, 1)
    assert recs[0]["acted"]
    saved = load_state(tmp_path)
    assert saved.state.in_flight == "scale_out(prefill)" and saved.action_pid == 4242
    assert saved.action_target == {"prefill": 2, "decode": 1}
    # a new process: its child is gone (pid 4242 runs no `pdtopo scale`), the plan reached 2P1D
    again = PlannerLoop(tmp_path, settings(), Budget(chips=3), PROFILE, scraper=load)
    assert isinstance(again.actor, ScaleActor) and again.actor.busy
    t, recs = run_ticks(again, t, 1)
    outcome = files.read_lines(tmp_path)[-2]
    assert outcome["event"] == "outcome" and outcome["ok"] is True
    assert "hysteresis" in recs[0]["reason"]  # the last change's time survived the restart
    assert load_state(tmp_path).state.in_flight is None


def test_scraper_windows_from_two_scrapes_and_skips_a_silent_instance():
    plan = expand_plan(compose_config(["model=tiny_llama"]), run_dir="/r", python="py",
                       cpus=[0, 1])
    leaders = [p for p in plan.processes if p.role in ("prefill", "decode")]
    texts = {0: "sglang:prompt_tokens_total 100\nsglang:num_queue_reqs 2\n",
             1: "sglang:prompt_tokens_total 600\nsglang:num_queue_reqs 3\n"}
    calls = {"n": 0}

    def fetch(url: str) -> str:
        if ":30001/" in url:  # decode_0 does not answer
            raise OSError("connection refused")
        calls["n"] += 1
        return texts[0 if calls["n"] == 1 else 1]

    s = Scraper(fetch)
    assert s.observe(leaders, 10.0) is None  # one scrape: no window yet
    obs = s.observe(leaders, 15.0)
    assert [i.name for i in obs.instances] == ["prefill_0"] and obs.interval_s == 5.0
    assert obs.instances[0].prompt_tps == 100.0 and obs.instances[0].busy
    assert s.errors == {"decode_0": "connection refused"}


def test_metrics_text_parses_as_prometheus():
    text = metrics_text(SavedState(PlannerState(in_flight="scale_out(prefill)"),
                                   {"none": 3, "scale_out": 1}, {"ok": 2}),
                        Counts(2, 1), None, True, 1.7e9 + 0.25)
    samples = {s.name: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if not s.labels}
    assert samples["pdtopo:planner_paused"] == 1
    assert samples["pdtopo:planner_change_in_flight"] == 1
    assert samples["pdtopo:planner_last_update_timestamp_seconds"] == 1.7e9 + 0.25
    assert "pdtopo:planner_decisions_total{action=\"scale_out\"} 1.0" in text


def test_guard_scale_pauses_by_hand_and_refuses_a_stale_planner(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("planner: {enabled: true, mode: act}\n")
    said: list[str] = []
    monkeypatch.delenv(files.SCALE_BY_ENV, raising=False)
    assert files.guard_scale(tmp_path, {"prefill": 1, "decode": 1}, ["decode=2"],
                             said.append) is None
    assert files.paused(tmp_path).startswith("`pdtopo scale decode=2` by hand")
    assert "planner resume" in said[0]
    monkeypatch.setenv(files.SCALE_BY_ENV, "planner")
    monkeypatch.setenv(files.SCALE_EXPECT_ENV, "prefill=1,decode=1")
    assert "paused" in files.guard_scale(tmp_path, {"prefill": 1, "decode": 1}, [], print)
    files.resume(tmp_path)
    assert files.guard_scale(tmp_path, {"prefill": 1, "decode": 1}, [], print) is None
    assert "prefill=1,decode=2 now" in files.guard_scale(
        tmp_path, {"prefill": 1, "decode": 2}, [], print)
    (tmp_path / "config.yaml").write_text("planner: {enabled: true, mode: recommend}\n")
    monkeypatch.delenv(files.SCALE_BY_ENV)
    files.guard_scale(tmp_path, {"prefill": 1, "decode": 1}, ["decode=2"], print)
    assert files.paused(tmp_path) is None  # a recommending planner has nothing to pause


def test_a_second_scale_waits_for_the_lock(tmp_path):
    order: list[str] = []
    said: list[str] = []
    with files.scale_lock(tmp_path, "the planner's `pdtopo scale prefill=2`", print):
        assert files.scale_under_way(tmp_path).startswith("the planner's `pdtopo scale")

        def second() -> None:
            with files.scale_lock(tmp_path, "by hand", said.append):
                order.append("second")

        th = threading.Thread(target=second)
        th.start()
        time.sleep(0.3)
        order.append("first done")
    th.join(5)
    assert order == ["first done", "second"]
    assert said and "waiting for the scale under way (the planner's" in said[0]
    assert files.scale_under_way(tmp_path) is None


def test_the_child_scale_runs_and_reports(tmp_path):
    """ScaleActor starts the real `pdtopo scale` (here on a run dir with no deployment: it
    refuses, exit 2, and the planner reads that as a failed change)."""
    actor = ScaleActor(tmp_path)
    (tmp_path / "logs").mkdir()
    decision = Decision(0.0, "scale_out", "prefill", None, Counts(1, 1), Counts(2, 1), "test",
                        None, None, {}, "act")  # type: ignore[arg-type]
    actor.start(decision, Counts(1, 1))
    deadline = time.monotonic() + 60
    while (ok := actor.poll(lambda: Counts(1, 1))) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ok is False and actor.proc is None
    log = (tmp_path / "logs" / "planner_scale.log").read_text()
    assert "scale_out(prefill): 1P1D -> 2P1D" in log and "pdtopo scale" in log


def test_planner_verb_status_pause_resume(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("planner: {enabled: false, mode: act}\n")
    assert planner_cli.run(tmp_path, "status") == 2
    assert "runs no planner" in capsys.readouterr().err
    loop, load, _scale = make_loop(tmp_path)
    (tmp_path / "config.yaml").write_text("planner: {enabled: true, mode: act, "
                                          "interval_s: 5}\n")
    load.prompt = 3 * P_CAP
    run_ticks(loop, 1000.0, 1)
    assert planner_cli.run(tmp_path, "pause") == 0
    assert files.paused(tmp_path).startswith("`pdtopo planner pause` (at ")
    assert planner_cli.run(tmp_path, "status") == 1  # no supervisord here: not RUNNING
    out = " ".join(capsys.readouterr().out.split())
    assert "planner program: supervisord does not answer" in out
    assert "scale_out(prefill) -> 2P1D [started]" in out and "PAUSED" in out
    assert planner_cli.run(tmp_path, "resume") == 0
    assert "was paused: `pdtopo planner pause`" in capsys.readouterr().out
    assert files.paused(tmp_path) is None


def test_a_stopped_planner_interrupts_its_scale_like_ctrl_c(tmp_path, monkeypatch):
    """SIGTERM to the planner (supervisord stopping it): its child gets SIGINT, as a Ctrl-C
    of `pdtopo scale` by hand, which rolls back what it began."""
    monkeypatch.setattr(planner_io, "scale_command", lambda run_dir, target: [
        sys.executable, "-c", "import time\ntry:\n time.sleep(60)\n"
        "except KeyboardInterrupt:\n print('rolled back')\n raise SystemExit(1)"])
    (tmp_path / "logs").mkdir()
    actor = ScaleActor(tmp_path)
    decision = Decision(0.0, "scale_out", "prefill", None, Counts(1, 1), Counts(2, 1), "test",
                        None, None, {}, "act")  # type: ignore[arg-type]
    actor.start(decision, Counts(1, 1))
    time.sleep(0.5)
    assert actor.poll(lambda: Counts(1, 1)) is None
    t0 = time.monotonic()
    assert actor.interrupt(10) == 1 and time.monotonic() - t0 < 5
    assert "rolled back" in (tmp_path / "logs" / "planner_scale.log").read_text()
