"""A start that survives Mosaic refusing the TPU attention kernel (no TPU here): the request
`engine.attention_impl=auto` is made to resolve to the kernel (interpreted), and the kernel's
compile is made to raise Mosaic's kind of error. The server's own load path
(`server.load_engine`) then warms up and serves the gather path's greedy tokens, says so in
/pdtopo/state, /metrics and an ERROR log naming the kernel and the step shape, and compiles
nothing while serving; the kernel asked for by name fails the start instead, naming the
setting. A refusal in the pool sizing's compile and a first run that fails after taking the
pool fall back the same way."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.kernels import ragged_attention
from pdtopo.ports import free_port
from pdtopo.runtime.api.app import create_app
from pdtopo.runtime.api.state import ServerState
from pdtopo.runtime.engine import attention as attn
from pdtopo.runtime.engine.attention_fallback import KERNEL_NAME, KernelRefused
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.engine.step_programs import StepPrograms
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.server import load_engine
from pdtopo.runtime.settings import direct_process_context
from tests.support.engine_greedy import greedy_fresh_colocated, greedy_req

SMALL = ["model=tiny_llama", "model.num_layers=1", "engine.max_running_requests=4",
         "engine.max_prefill_tokens=32", "engine.max_model_len=64",
         "launcher.compilation_cache_dir=null"]
MOSAIC = ("Mosaic failed to compile TPU kernel: vector.shape_cast with an unaligned second-minor "
          "dimension is not implemented\n\nThe MLIR operation involved:\n  %12 = vector.shape_cast")
PROMPTS = [[1, 5, 9, 12, 40, 7], [3] * 37, [8]]


@pytest.fixture
def on_a_tpu(monkeypatch):
    """`auto` and `pallas` resolve to the kernel, as on a TPU (interpreted: this is a CPU)."""
    real = attn.resolve_impl

    def resolve(impl, head_dim, platform=None):
        return "pallas_interpret" if impl in ("auto", "pallas") else real(impl, head_dim, platform)

    monkeypatch.setattr(attn, "resolve_impl", resolve)


@pytest.fixture
def mosaic_refuses(monkeypatch, on_a_tpu):
    """Tracing the kernel raises what Mosaic says when it refuses a kernel."""
    def refuse(*args, **kwargs):
        raise RuntimeError(MOSAIC)

    monkeypatch.setattr(ragged_attention, "ragged_paged_attention", refuse)


def test_auto_falls_back_to_gather_serves_and_says_so(mosaic_refuses, caplog):
    cfg = compose_config([*SMALL, "engine.attention_impl=auto"])
    state = ServerState(direct_process_context(cfg, port=free_port()))
    with caplog.at_level(logging.ERROR, logger="pdtopo"):
        load_engine(state)  # the server's load: runner, warmup, scheduler, its warmup, start
    sched, runner = state.scheduler, state.runner
    try:
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, errors
        assert KERNEL_NAME in errors[0] and "step shape ragged/1/1" in errors[0]
        assert "Mosaic failed to compile TPU kernel" in errors[0]
        assert "gather path" in errors[0]
        assert runner.attention_impl == "gather" and runner.geometry.layout_kind == "paged"
        warmed = runner.compiled_keys()
        assert warmed == runner.shape_grid() and "ragged" not in {k[0] for k in warmed}
        reqs = [greedy_req(p, 6) for p in PROMPTS]
        for r in reqs:
            sched.submit(r)
        served = [list(r.sink.collect(120)[0]) for r in reqs]
        assert runner.compiled_keys() == warmed, "a step shape compiled while serving"
        with TestClient(create_app(state)) as client:
            st = client.get("/pdtopo/state").json()
            metrics = client.get("/metrics").text
    finally:
        sched.stop()
    assert st["attention"].startswith("gather (pallas refused: Mosaic failed to compile TPU "
                                      "kernel: vector.shape_cast")
    assert "MLIR" not in st["attention"]  # the first line only
    assert ('pdtopo:attention_info{fallback_reason="Mosaic failed to compile TPU kernel: '
            'vector.shape_cast') in metrics
    assert 'impl="gather",requested="auto"} 1.0' in metrics
    plain = compose_config([*SMALL, "engine.attention_impl=gather"])
    assert served == greedy_fresh_colocated(plain, load_tokenizer(plain.model), PROMPTS, 6)


def test_the_kernel_asked_for_by_name_fails_the_start(mosaic_refuses, monkeypatch):
    cfg = compose_config([*SMALL, "engine.attention_impl=pallas"])
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    with pytest.raises(KernelRefused, match=r"engine.attention_impl=pallas: the TPU kernel .* "
                       r"failed to compile for step shape ragged/1/1 .*Mosaic failed.*; use "
                       r"engine.attention_impl=auto to fall back to the gather path, or gather"):
        runner.warmup()
    # a pool sized from device memory compiles the largest step first: refused there
    monkeypatch.setattr(ModelRunner, "_memory_stats",
                        lambda self: {"bytes_limit": 2**30, "bytes_in_use": 0})
    eng = OmegaConf.merge(cfg.engine, {"kv_memory_fraction": 0.01})
    with pytest.raises(KernelRefused, match="engine.attention_impl=pallas: .*ragged/32/4"):
        ModelRunner(cfg.model, eng, build_mesh(1))
    auto = ModelRunner(cfg.model, OmegaConf.merge(eng, {"attention_impl": "auto"}),
                       build_mesh(1))
    assert auto.attention_path().label.startswith("gather (pallas refused: Mosaic failed")
    assert auto.geometry.layout_kind == "paged"  # before the pool: sized for the gather path


def test_a_first_run_that_fails_after_taking_the_pool(on_a_tpu, monkeypatch):
    """The kernel compiles but its first run fails once the pool was donated: the runner
    falls back with a new pool."""
    real_compile, real_run = StepPrograms.compile, StepPrograms.run

    def compile_(self, key, *args):
        return 0.0 if key[0] == "ragged" else real_compile(self, key, *args)  # as if compiled

    def run(self, key, params, caches, *args):
        if key[0] == "ragged":
            caches[0].delete()
            caches[1].delete()
            raise RuntimeError("INTERNAL: Mosaic failed to compile TPU kernel: at run\nmore")
        return real_run(self, key, params, caches, *args)

    monkeypatch.setattr(StepPrograms, "compile", compile_)
    monkeypatch.setattr(StepPrograms, "run", run)
    cfg = compose_config([*SMALL, "engine.attention_impl=auto"])
    runner = ModelRunner(cfg.model, cfg.engine, build_mesh(1))
    runner.warmup()
    assert runner.attention_path().fallback_reason == \
        "INTERNAL: Mosaic failed to compile TPU kernel: at run"
    assert not any(a.is_deleted() for a in runner.kv_caches)
    assert len(runner.kv_caches) == 2 * runner.config.num_layers
    assert runner.compiled_keys() == runner.shape_grid()
