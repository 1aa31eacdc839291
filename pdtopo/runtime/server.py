"""Process entry of a pdtopo P / D / colocated server.

    python -m pdtopo.runtime.server --run-dir RUN --process NAME       (launcher form)
    python -m pdtopo.runtime.server --port 30000 [hydra overrides...]  (one colocated server)

Startup: read the `ProcessContext`, apply the process's `cpu_affinity`, start uvicorn at once
(`/health` answers 503 "loading" meanwhile) and load the engine on a loader thread: mesh of
`process.mesh.tp` devices, tokenizer, `ModelRunner` (+ warmup), scheduler (+ sampler warmup),
scheduler thread (role `local`: `pdtopo.runtime.local.engine` builds several engines instead).
The attention path warmup settled on (the TPU kernel, or the gather path when Mosaic refused
it: pdtopo.runtime.engine.attention_fallback) goes to /metrics. Then `/health` turns 200.
SIGTERM / SIGINT: uvicorn shuts down gracefully, then the scheduler thread is stopped
(in-flight requests end with an abort).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
import time

import uvicorn

from pdtopo.config.compose import compose_config
from pdtopo.config.settings import runtime_settings
from pdtopo.logs import configure_logging
from pdtopo.runtime.api.app import create_app
from pdtopo.runtime.api.http_probe import HttpProtocol
from pdtopo.runtime.api.state import ServerState
from pdtopo.runtime.distributed import start_process
from pdtopo.runtime.engine.attention_fallback import attention_label
from pdtopo.runtime.engine.compilation_cache import enable_compilation_cache
from pdtopo.runtime.model.tokenizer import load_tokenizer
from pdtopo.runtime.settings import ProcessContext, direct_process_context, load_process_context

log = logging.getLogger("pdtopo.server")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdtopo.runtime.server",
                                description="pdtopo serving engine (P, D or colocated server)")
    p.add_argument("--run-dir", help="launcher run directory (config.yaml + plan.json)")
    p.add_argument("--process", help="process name in the plan (with --run-dir)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (direct form)")
    p.add_argument("--host", default=None, help="bind host (direct form; default "
                   "server.bind_host)")
    p.add_argument("overrides", nargs="*", help="hydra overrides (direct form), e.g. "
                   "model.num_layers=2")
    args = p.parse_args(argv)
    if args.run_dir and not args.process:
        p.error("--run-dir needs --process NAME")
    if args.process and not args.run_dir:
        p.error("--process needs --run-dir RUN")
    if args.run_dir and args.overrides:
        p.error("hydra overrides are only for the direct form (no --run-dir)")
    return args


def build_context(args: argparse.Namespace) -> ProcessContext:
    if args.run_dir:
        return load_process_context(args.run_dir, args.process)
    cfg = compose_config(args.overrides)
    host = args.host or runtime_settings(cfg).server.bind_host or "127.0.0.1"
    return direct_process_context(cfg, port=args.port, host=host)


def apply_cpu_affinity(ctx: ProcessContext) -> None:
    cpus = ctx.process.get("cpu_affinity")
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus})
        log.info("CPU affinity: %s", sorted(int(c) for c in cpus))


# role -> module whose `build_server_engine(ctx, tokenizer, metrics)` assembles the engine
# (default: `build_engine` below). Local disaggregation runs several engines in one process.
ENGINE_BUILDERS = {"local": "pdtopo.runtime.local.engine"}


def build_engine(ctx: ProcessContext, tokenizer, metrics):
    """One mesh, one runner and the role's scheduler (P, D or colocated), warmed up."""
    # deferred: these import JAX, which loads on the loader thread while /health answers 503
    from pdtopo.config.pool_reserve import reserved_pages
    from pdtopo.runtime.engine.mesh import build_mesh
    from pdtopo.runtime.engine.model_runner import ModelRunner, warmup_kinds
    from pdtopo.runtime.scheduler_factory import make_scheduler

    cfg = ctx.cfg
    tp = int(ctx.process.get("mesh", {}).get("tp", 1))
    mesh = build_mesh(tp)
    log.info("mesh tp=%d on %s", tp, [str(d) for d in mesh.devices.flat])
    runner = ModelRunner(cfg.model, ctx.settings.engine, mesh,
                         reserve_pages=reserved_pages(ctx.settings, ctx.role))
    log.info("model loaded (%d KV pages x %d tokens); warming up ...", runner.num_pages,
             runner.page_size)
    runner.warmup(**warmup_kinds(ctx.role))
    scheduler = make_scheduler(ctx, runner, tokenizer, metrics=metrics)
    scheduler.warmup()
    return runner, scheduler


def load_engine(state: ServerState) -> None:
    """Build tokenizer, runner(s), scheduler; warm up; start the scheduler thread(s)."""
    ctx = state.ctx
    cfg = ctx.cfg
    enable_compilation_cache(ctx.settings.launcher.compilation_cache_dir)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    log.info("loading model %s ...", cfg.model.name)
    module = ENGINE_BUILDERS.get(ctx.role)
    builder = importlib.import_module(module).build_server_engine if module else build_engine
    runner, scheduler = builder(ctx, tokenizer, state.metrics)
    compiled = getattr(scheduler, "compile_count", runner.compile_count)()
    paths = scheduler.attention_paths()  # after warmup: the kernel, or gather if it was refused
    state.metrics.set_attention(paths)
    log.info("engine loaded and warmed up in %.1fs (%d compiled step shapes; attention: %s)",
             time.perf_counter() - t0, compiled, attention_label(paths))
    state.tokenizer, state.runner, state.scheduler = tokenizer, runner, scheduler
    scheduler.start()
    state.ready = True


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would kill the
    process before the scheduler thread is stopped; we stop it and exit 0 ourselves."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        log.info("signal %d: shutting down", sig)


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = parse_args(argv)
    ctx = build_context(args)
    apply_cpu_affinity(ctx)
    rc = start_process(ctx)  # multi-process instance: join its JAX cluster; a follower ends here
    if rc is not None:
        return rc
    host = ctx.address if not args.run_dir else ctx.bind_host
    port = int(ctx.ports["http"])
    state = ServerState(ctx)
    app = create_app(state)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    timeout_graceful_shutdown=5, http=HttpProtocol,
                                    timeout_keep_alive=ctx.settings.server.keep_alive_s))

    def loader() -> None:
        state.load_progress.attach()
        try:
            load_engine(state)
            log.info("%s (%s) ready at http://%s:%d", ctx.name, ctx.role, host, port)
        except Exception as exc:
            log.exception("engine failed to load")
            state.load_error = f"{type(exc).__name__}: {exc}"
            server.should_exit = True
        finally:
            state.load_progress.detach()

    log.info("%s (%s) starting on http://%s:%d (health 503 until loaded)", ctx.name, ctx.role,
             host, port)
    threading.Thread(target=loader, name="engine-loader", daemon=True).start()
    try:
        server.run()
    finally:
        if state.scheduler is not None:
            state.scheduler.stop()
        log.info("%s stopped", ctx.name)
    return 1 if state.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
