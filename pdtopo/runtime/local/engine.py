"""Assemble a local-disaggregation process from its `ProcessContext`.

`build_local_engine(ctx, tokenizer, metrics)`:
  layout    `topology.prefill_slices` / `decode_slices` over this process's devices (slices.py)
  engines   per slice: a 1-D tp mesh over its devices, a `ModelRunner` (weights + its own KV
            pool) and a scheduler with the local prefill or decode mixin
  queues    transfer backlog (`local.transfer_backlog`); per decode engine a backlog of
            `local.decode_backlog` items, or (null) as many as its pool holds max-length
            requests (at least 1)
  faults    `local.fault_inject_thread` (prefill_K | transfer | decode_K) crashes at its
            `local.fault_inject_after_steps`-th busy step
and returns the (not yet warmed up, not started) `LocalOrchestrator`.
`build_server_engine` is the server entry's hook: build, warm up, return (runner, facade).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Sequence
from typing import Any

import jax

from pdtopo.config.local_slices import LocalLayout, layout_from_topology
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.engine.metrics import EngineMetrics
from pdtopo.runtime.engine.model_runner import ModelRunner
from pdtopo.runtime.engine.scheduler import Scheduler
from pdtopo.runtime.local.board import DecodeLoad, RequestBoard
from pdtopo.runtime.local.decode import LocalDecodeMixin
from pdtopo.runtime.local.metrics_view import EngineMetricsView, GaugeBoard
from pdtopo.runtime.local.orchestrator import LocalOrchestrator
from pdtopo.runtime.local.prefill import LocalPrefillMixin
from pdtopo.runtime.local.transfer import TransferWorker
from pdtopo.runtime.worker_threads import CrashHandler, FaultInjector, crash_process

log = logging.getLogger("pdtopo.local")


class LocalPrefillScheduler(LocalPrefillMixin, Scheduler):
    """Prefill on the prefill mesh, then hand KV + request to the transfer thread."""


class LocalDecodeScheduler(LocalDecodeMixin, Scheduler):
    """Decode on one decode mesh, fed by the transfer thread."""


def worker_names(layout: LocalLayout) -> list[str]:
    return [s.name for s in layout.prefill] + ["transfer"] + [s.name for s in layout.decode]


def build_local_engine(ctx, tokenizer, metrics: EngineMetrics | None = None, *,
                       devices: Sequence[Any] | None = None,
                       on_crash: CrashHandler = crash_process) -> LocalOrchestrator:
    cfg = ctx.cfg
    devs = list(jax.devices() if devices is None else devices)
    layout = layout_from_topology(cfg.topology, len(devs))
    loc = ctx.settings.local
    target = loc.fault_inject_thread
    names = worker_names(layout)
    if target is not None and target not in names:
        raise ValueError(f"local.fault_inject_thread={target!r} is not a worker of this "
                         f"process (workers: {', '.join(names)})")
    after = loc.fault_inject_after_steps
    if metrics is None:
        metrics = EngineMetrics(str(cfg.model.name), "local")
    gauges = GaugeBoard(metrics)
    board, load = RequestBoard(), DecodeLoad(len(layout.decode))
    stopping = threading.Event()
    transfer_backlog: queue.Queue = queue.Queue(maxsize=loc.transfer_backlog)
    impl = ctx.settings.kernels.impl

    def common(s) -> dict[str, Any]:
        mesh = build_mesh(s.size, devs[s.first_device:s.first_device + s.size])
        log.info("%s: tp=%d on %s", s.name, s.size, [str(d) for d in mesh.devices.flat])
        runner = ModelRunner(cfg.model, ctx.settings.engine, mesh)
        return {"runner": runner, "engine_name": s.name, "board": board,
                "fault": FaultInjector(s.name, target, after), "on_crash": on_crash,
                "stopping": stopping, "metrics": EngineMetricsView(gauges, s.name)}

    prefills = []
    for s in layout.prefill:
        kw = common(s)
        runner = kw.pop("runner")
        prefills.append(LocalPrefillScheduler(ctx, runner, tokenizer,
                                              transfer_backlog=transfer_backlog, **kw))
    decodes = []
    for i, s in enumerate(layout.decode):
        kw = common(s)
        runner = kw.pop("runner")
        cap = loc.decode_backlog
        if cap is None:
            per_req = math.ceil(runner.max_model_len / runner.page_size)
            cap = max(1, (runner.num_pages - 1) // per_req)
        decodes.append(LocalDecodeScheduler(ctx, runner, tokenizer, index=i,
                                            backlog=queue.Queue(maxsize=cap), load=load,
                                            kernels_impl=impl, **kw))
    transfer = TransferWorker(transfer_backlog, decodes, load,
                              FaultInjector("transfer", target, after), stopping)
    return LocalOrchestrator(prefills, decodes, transfer_backlog=transfer_backlog,
                             transfer=transfer, board=board, load=load, stopping=stopping,
                             on_crash=on_crash)


def build_server_engine(ctx, tokenizer, metrics):
    """Server entry hook: (a runner for information, the warmed-up facade)."""
    orch = build_local_engine(ctx, tokenizer, metrics)
    orch.warmup()
    return orch.prefills[0].runner, orch
