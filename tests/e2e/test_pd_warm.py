"""A warmed-up P and D pair (real runners, transfer servers and ZMQ side channel, no HTTP)
serves prompts of every page count and batch size without compiling anything: the step
shapes, the sampler and the KV gather / scatter are all compiled by the roles' warmups; so are
a reshard's cuts on P (tp=2) and piece scatters on D (tp=1)."""

from __future__ import annotations

import dataclasses
import random

import jax
import pytest

from pdtopo.config.compose import compose_config
from pdtopo.ports import free_port
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner, warmup_kinds
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.scheduler_factory import make_scheduler
from pdtopo.runtime.settings import direct_process_context

pytestmark = pytest.mark.slow  # real model runners behind real schedulers

OVERRIDES = ["model=tiny_llama", "model.num_layers=2", "engine.num_pages=96", "engine.page_size=8",
             "engine.max_model_len=96", "engine.max_running_requests=8",
             "engine.max_prefill_tokens=64", "disaggregation.kv_timeout_s=20"]


def _contexts(cfg, tps: dict[str, int]) -> dict:
    """P and D contexts whose plan holds both (each warms for the other's layout)."""
    ctxs = {role: direct_process_context(
        cfg, role=role, name=f"{role}_0",
        extra={"ports": {"http": free_port(), "transfer": free_port(), "zmq": free_port()},
               "instance_id": f"{role}_0", "mesh": {"tp": tp}}) for role, tp in tps.items()}
    plan = {"processes": [c.process for c in ctxs.values()]}
    return {role: dataclasses.replace(c, plan=plan) for role, c in ctxs.items()}


def _scheduler(ctx, tok):
    cfg = ctx.cfg
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(int(ctx.process["mesh"]["tp"])))
    runner.warmup(**warmup_kinds(ctx.role))
    sched = make_scheduler(ctx, runner, tok)
    sched.warmup()
    return sched


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1)], ids=["same-layout", "resharded"])
def test_warm_pd_pair_compiles_nothing_while_serving(p_tp, d_tp):
    cfg = compose_config(OVERRIDES)
    tok = load_tokenizer(cfg.model)
    ctxs = _contexts(cfg, {"prefill": p_tp, "decode": d_tp})
    p, d = _scheduler(ctxs["prefill"], tok), _scheduler(ctxs["decode"], tok)
    assert bool(p.decode_layouts) == (p_tp != d_tp)  # P waits for D's layout, cuts for it
    compiles: list[float] = []

    def on_event(event: str, duration: float, **_kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    p.start()
    d.start()
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        rng = random.Random(1)
        # every page count from 1 to the longest prompt, submitted in waves of up to 8
        lengths = list(range(1, 88, 3))
        rng.shuffle(lengths)
        reqs = []
        for room, n in enumerate(lengths, start=100):
            prompt = [256] + [rng.randrange(1, 255) for _ in range(n - 1)]
            new = rng.randrange(1, 96 - n + 1)
            pair = []
            for _ in ("prefill", "decode"):
                r = Req(rid=new_rid(), prompt_ids=list(prompt), sink=QueueSink(),
                        sampling=SamplingParams(max_new_tokens=new, temperature=0.0,
                                                ignore_eos=True))
                r.bootstrap_room = room
                r.bootstrap_host, r.bootstrap_port = "127.0.0.1", p.kv_manager.channel.port
                pair.append(r)
            reqs.append(pair)
        for i in range(0, len(reqs), 8):
            wave = reqs[i:i + 8]
            for rp, rd in wave:
                d.submit(rd)
                p.submit(rp)
            for rp, rd in wave:
                _, p_out = rp.sink.collect(60)
                d_ids, d_out = rd.sink.collect(60)
                assert d_out.finish_reason["type"] == "length", d_out.finish_reason
                assert len(d_ids) == rd.sampling.max_new_tokens
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
        p.stop()
        d.stop()
    assert compiles == [], f"{len(compiles)} XLA compilations while serving"
