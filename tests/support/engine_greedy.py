"""Greedy tokens straight from pdtopo's schedulers (real runners, transfer servers and the ZMQ
side channel; no HTTP): colocated, and through a P/D pair, for comparing against a reference.

    scheduler_for(cfg, role, tok, tp)          -> (scheduler, runner), not started
    greedy_colocated(sched, batch, n)          -> each prompt's n greedy tokens (EOS ignored);
                                                  starts and stops `sched`
    greedy_fresh_colocated(cfg, tok, batch, n) -> the same through a new colocated scheduler
    greedy_fresh_pd(cfg, tok, batch, n)        -> the same through a new P/D pair of `cfg`
    `logprobs=k` (k >= 0) on any of them: each prompt's finished `Req` instead of its tokens
    (D's in PD), whose `output_logprobs` hold the sampled tokens' logprobs and top k
"""

from __future__ import annotations

from pdtopo.ports import free_port
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.engine.request import QueueSink, Req, SamplingParams, new_rid
from pdtopo.runtime.scheduler_factory import make_scheduler
from pdtopo.runtime.settings import direct_process_context


def scheduler_for(cfg, role: str, tok, tp: int = 1):
    ports = {"http": free_port(), "transfer": free_port(), "zmq": free_port()}
    ctx = direct_process_context(cfg, role=role, name=f"{role}_0",
                                 extra={"ports": ports, "mesh": {"tp": tp}})
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(tp))
    return make_scheduler(ctx, runner, tok), runner


def greedy_req(prompt: list[int], n: int, logprobs: int = -1) -> Req:
    return Req(rid=new_rid(), prompt_ids=list(prompt), sink=QueueSink(),
               sampling=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                       logprobs=logprobs))


def greedy_colocated(sched, batch: list[list[int]], n: int, logprobs: int = -1) -> list:
    """Start `sched` (not started yet), run the batch through it, stop it."""
    sched.start()
    try:
        reqs = [greedy_req(p, n, logprobs) for p in batch]
        for r in reqs:
            sched.submit(r)
        outs = [list(r.sink.collect(120)[0]) for r in reqs]
        return reqs if logprobs >= 0 else outs
    finally:
        sched.stop()


def greedy_fresh_colocated(cfg, tok, batch: list[list[int]], n: int,
                           logprobs: int = -1) -> list:
    """`greedy_colocated` through a new colocated scheduler of `cfg`."""
    return greedy_colocated(scheduler_for(cfg, "colocated", tok)[0], batch, n, logprobs)


def greedy_pd(p_sched, d_sched, batch: list[list[int]], n: int, logprobs: int = -1) -> list:
    pairs = []
    for room, prompt in enumerate(batch, start=500):
        rp, rd = greedy_req(prompt, n, logprobs), greedy_req(prompt, n, logprobs)
        for r in (rp, rd):
            r.bootstrap_room = room
            r.bootstrap_host, r.bootstrap_port = "127.0.0.1", p_sched.kv_manager.channel.port
        pairs.append((rp, rd))
    for rp, rd in pairs:
        d_sched.submit(rd)
        p_sched.submit(rp)
    out = []
    for rp, rd in pairs:
        rp.sink.collect(120)
        ids, final = rd.sink.collect(120)
        assert final.finish_reason["type"] == "length", final.finish_reason
        out.append(rd if logprobs >= 0 else list(ids))
    return out


def greedy_fresh_pd(cfg, tok, batch: list[list[int]], n: int, logprobs: int = -1) -> list:
    """`greedy_pd` through a new P/D scheduler pair of `cfg`, started and stopped here."""
    p_sched, _ = scheduler_for(cfg, "prefill", tok)
    d_sched, _ = scheduler_for(cfg, "decode", tok)
    p_sched.start()
    d_sched.start()
    try:
        return greedy_pd(p_sched, d_sched, batch, n, logprobs)
    finally:
        p_sched.stop()
        d_sched.stop()
