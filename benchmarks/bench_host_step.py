"""The host's part of a decode step (issue 48): what the scheduler thread and the HTTP layer
cost per step at the batch sizes a TPU runs, on a model whose device work is small.

    python benchmarks/bench_host_step.py [--batches 1,64,256] [--tokens 256] [hydra overrides]

Serving: a real pdtopo server in this process (`load_engine`, the scheduler thread, uvicorn as
`python -m pdtopo.runtime.server` runs it) streaming sglang `/generate` SSE to real concurrent
clients (aiohttp, else httpx, in a subprocess: another interpreter, as remote clients would
be). Model: a random one-layer Llama (hidden 32, 2 heads of 16) whose vocabulary stays real:
131,072 ids, the head and the greedy sampler over all of them, and a byte-level BPE tokenizer
of 131,072 ids built here with `tokenizers` (no download). Requests: 16-token prompts, greedy, `ignore_eos`,
256 new tokens each. On this CPU the 131,072-wide head and argmax are most of the device
time at batch 256 (on a TPU they take well under a millisecond).

Per batch size (1, 64, 256 streams at once), with `engine.overlap_schedule` off and on:
  wall ms per step     the decode window (every stream running, none waiting) over its steps
  device ms per step   the step programs alone on the same shapes, timed apart (one-token
                       chunks at mid-run context, inputs already on the device: the layer and
                       head programs and the sampler, then block_until_ready): the median of
                       10 before and 10 after the batch's runs
  host ms per step     wall (overlap off) - device: all host cost, nothing hidden
and, from a third run with timing hooks (overlap off), where the host time goes: wall and
thread CPU time in the scheduler thread's functions (exclusive of the hooked functions they
call; wall - CPU is mostly waiting for the GIL), and the CPU of the HTTP event-loop thread,
which shares the scheduler's GIL. The hooks wrap methods of this process's scheduler, runner,
tokenizer and routes for that run only (nothing in pdtopo changes; without them nothing is
wrapped); their own cost is in the hooked run's wall, printed beside the plain one.

Backlog: more clients than `engine.max_running_requests` (closed loop: each client sends its
next request when one ends; 64..256 new tokens each, so requests end at different steps and
some always wait): steps/s and tokens/s with overlap on / off over the same window of time.

Before it, the ceiling: the most overlap can give with the measured device and host times,
(device + host) / max(device, host), and the device step under which a host part of 1 ms
and an overlap of 1.3x can hold together (1 / 0.3 = 3.33 ms: a TPU's step, not this CPU's).
The last line: `host ms per decode step at batch 256 = X.XX; overlap under backlog = Y.YYx`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

VOCAB = 131072
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]
PROMPT_LEN = 16
HOST_GOAL_MS, OVERLAP_GOAL = 1.0, 1.3  # issue 48's goals at batch 256 (the ceiling line)
DEFAULTS = ["model=hf_local", "model.name=host-step", "engine.max_running_requests=256",
            "engine.max_prefill_tokens=1024", "engine.max_model_len=1024",
            "engine.kv_memory_fraction=null", "engine.num_pages=8192",
            "engine.max_new_tokens_limit=512", "engine.overlap_schedule=true"]


# ---------------------------------------------------------------------------- clients
# The client side runs in its own interpreter (`--client JSON`): no JAX, no pdtopo engine.
def _outcome(chunks: list[dict], body: dict) -> tuple[int, str | None]:
    """(output tokens the last chunk reported, error or None) of one stream's chunks."""
    if not chunks:
        return 0, "no_chunks"
    if "error" in chunks[-1]:
        return 0, "stream_error"
    reason = (chunks[-1]["meta_info"].get("finish_reason") or {}).get("type")
    n = len(chunks[-1]["output_ids"])
    if reason != "length":
        return n, f"finish_{reason}"
    return n, None if n == body["sampling_params"]["max_new_tokens"] else "short"


async def _stream_aiohttp(session, url: str, body: dict) -> tuple[int, str | None]:
    async with session.post(f"{url}/generate", json=body) as resp:
        if resp.status != 200:
            return 0, f"http_{resp.status}"
        last = b""
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                last = line  # parsed at the end: the clients share this machine's 2 CPUs
        return _outcome([json.loads(last[6:])] if last else [], body)


async def _stream_httpx(client, url: str, body: dict) -> tuple[int, str | None]:
    async with client.stream("POST", f"{url}/generate", json=body) as resp:
        if resp.status_code != 200:
            return 0, f"http_{resp.status_code}"
        last = ""
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and not line.startswith("data: [DONE]"):
                last = line
        return _outcome([json.loads(last[6:])] if last else [], body)


def _session():
    """(client session, its stream function): aiohttp (the test extra's: lighter per chunk),
    else httpx."""
    try:
        import aiohttp
    except ImportError:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(timeout=None, limits=limits), _stream_httpx
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    return (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout),
            _stream_aiohttp)


async def _clients(spec: dict) -> dict:
    rng = random.Random(spec["seed"])
    lo, hi = spec["tokens"]
    counter = iter(range(spec["requests"]))
    stop_at = time.monotonic() + spec["seconds"] if spec.get("seconds") else None
    done = {"requests": 0, "tokens": 0, "errors": {}}
    session, stream = _session()

    async def worker() -> None:
        for _ in counter:
            if stop_at is not None and time.monotonic() >= stop_at:
                return
            body = {"input_ids": [rng.randrange(256, VOCAB - len(SPECIALS))
                                  for _ in range(PROMPT_LEN)],
                    "sampling_params": {"max_new_tokens": rng.randint(lo, hi),
                                        "temperature": 0.0, "ignore_eos": True},
                    "stream": True}
            try:
                got, err = await stream(session, spec["url"], body)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - counted, never raised
                got, err = 0, type(exc).__name__
            done["requests"] += err is None
            done["tokens"] += got
            if err:
                done["errors"][err] = done["errors"].get(err, 0) + 1

    async with session:
        tasks = [asyncio.create_task(worker()) for _ in range(spec["concurrency"])]
        if stop_at is None:
            await asyncio.gather(*tasks)
        else:  # a timed run: whatever is still streaming at the end is dropped (aborted)
            await asyncio.wait(tasks, timeout=max(0.0, stop_at - time.monotonic()))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    done["cpu_s"] = time.process_time()
    return done


def client_main(spec_json: str) -> int:
    print(json.dumps(asyncio.run(_clients(json.loads(spec_json)))))
    return 0


def run_clients(url: str, concurrency: int, requests: int, tokens: tuple[int, int],
                seconds: float | None = None, seed: int = 0) -> dict:
    spec = {"url": url, "concurrency": concurrency, "requests": requests, "tokens": tokens,
            "seconds": seconds, "seed": seed}
    res = subprocess.run([sys.executable, __file__, "--client", json.dumps(spec)],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"clients failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the model
def write_model(root: Path) -> Path:
    """A random one-layer Llama checkpoint with a 131,072-id byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from pdtopo.model_config.random_checkpoint import (
        TEMPLATE,
        CheckpointShape,
        write_random_checkpoint,
    )

    shape = CheckpointShape(vocab=VOCAB, hidden=32, ffn=64, layers=1, heads=2, kv_heads=1,
                            rope_theta=10000.0)
    write_random_checkpoint(root, arch="llama", tied=True, seed=0, shape=shape)
    # merges of random pieces, mostly ASCII letters and spaces, until the vocabulary is full
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    common = [c for c in alphabet if c.isascii() and c.isalpha()] + ["\u0120"] * 8  # Ġ: space
    vocab = {c: i for i, c in enumerate(alphabet)}
    pieces, merges = list(alphabet), []
    rng = random.Random(0)
    while len(vocab) < VOCAB - len(SPECIALS):
        a = pieces[rng.randrange(len(pieces))] if rng.random() < 0.6 else rng.choice(common)
        b = rng.choice(common) if rng.random() < 0.9 else rng.choice(alphabet)
        if a + b in vocab or len(a + b) > 12:
            continue
        vocab[a + b] = len(vocab)
        pieces.append(a + b)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    tok.save(str(root / "tokenizer.json"))
    eos = VOCAB - 1
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "chat_template": TEMPLATE}))
    config = json.loads((root / "config.json").read_text())
    config.update(eos_token_id=eos, bos_token_id=VOCAB - 2)
    (root / "config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return root


# ---------------------------------------------------------------------------- the server
class Server:
    """A pdtopo server in this process: the engine as `pdtopo.runtime.server` loads it, uvicorn
    on a thread of its own (the HTTP event loop)."""

    def __init__(self, overrides: list[str]):
        import uvicorn

        from pdtopo.config.compose import compose_config
        from pdtopo.ports import free_port
        from pdtopo.runtime.api.app import create_app
        from pdtopo.runtime.api.http_probe import HttpProtocol
        from pdtopo.runtime.api.state import ServerState
        from pdtopo.runtime.server import load_engine
        from pdtopo.runtime.settings import direct_process_context

        port = free_port()
        self.cfg = compose_config(DEFAULTS + overrides)
        ctx = direct_process_context(self.cfg, port=port, host="127.0.0.1")
        self.state = ServerState(ctx)
        load_engine(self.state)  # tokenizer, runner + warmup, scheduler + warmup, its thread
        self.scheduler, self.runner = self.state.scheduler, self.state.runner
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(self.state), host="127.0.0.1", port=port, log_level="warning",
            http=HttpProtocol, timeout_keep_alive=ctx.settings.server.keep_alive_s))
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.recorder = StepRecorder(self.scheduler, self.thread)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.stop()


def _thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class StepRecorder:
    """After every scheduler step (while recording): time, counters, queue lengths, the CPU
    time of the scheduler thread, the HTTP thread and the process, and the profile's totals."""

    def __init__(self, scheduler, http_thread: threading.Thread):
        self.s, self.http = scheduler, http_thread
        self.records: list[tuple] = []
        self.recording = False
        self.profile: Profile | None = None
        step = scheduler.step

        def recorded_step() -> None:
            step()
            if self.recording:
                s = self.s
                acc = self.profile.snapshot() if self.profile is not None else None
                self.records.append((
                    time.perf_counter(), s.num_forward, s.num_generated, len(s.running),
                    len(s.waiting), s.num_overlapped_steps,
                    time.thread_time(), _thread_cpu(self.http),
                    time.process_time(), acc))

        scheduler.step = recorded_step

    def start(self) -> None:
        self.records = []
        self.recording = True

    def stop(self) -> list[tuple]:
        self.recording = False
        return self.records


# ---------------------------------------------------------------------------- profiling hooks
class Profile:
    """Exclusive wall and thread-CPU time per (thread, group) of wrapped callables: a wrapped
    call's time minus that of the wrapped calls inside it. `wrap()` wraps, `remove()` restores."""

    def __init__(self, labels: dict[int, str]):
        self.wall: dict[tuple[str, str], float] = {}
        self.cpu: dict[tuple[str, str], float] = {}
        self.labels = labels  # thread ident -> "sched" | "http"
        self._stacks: dict[int, list[list[float]]] = {}
        self._undo: list[tuple] = []

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.wall), dict(self.cpu)  # each copy is atomic under the GIL

    def wrapped(self, fn, group: str):
        wall, cpu, stacks, labels = self.wall, self.cpu, self._stacks, self.labels
        perf, thread_time, ident = time.perf_counter, time.thread_time, threading.get_ident

        def wrapper(*args, **kwargs):
            tid = ident()
            stack = stacks.get(tid)
            if stack is None:
                stack = stacks[tid] = []
            stack.append([0.0, 0.0])
            t0, c0 = perf(), thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, dc = perf() - t0, thread_time() - c0
                inner = stack.pop()
                key = (labels.get(tid, "other"), group)
                wall[key] = wall.get(key, 0.0) + dt - inner[0]
                cpu[key] = cpu.get(key, 0.0) + dc - inner[1]
                if stack:
                    stack[-1][0] += dt
                    stack[-1][1] += dc

        return wrapper

    def wrap(self, owner, name: str, group: str) -> None:
        self._undo.append((owner, name, vars(owner).get(name)))  # None: a class's method
        setattr(owner, name, self.wrapped(getattr(owner, name), group))

    def remove(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()


def install_profile(server: Server, full: bool) -> Profile:
    """Hooks for one run: the device clock (the step programs' launch, the wait for a step,
    its readback: a few calls a step), and with `full` every group of the breakdown."""
    import jax

    from pdtopo.runtime.api import native_routes
    from pdtopo.runtime.engine import model_runner
    from pdtopo.runtime.engine.sampling import PendingSample

    s, r = server.scheduler, server.runner
    p = Profile({s._thread.ident: "sched", server.thread.ident: "http"})
    if full:
        for name, group in (("step", "loop"), ("drain_inbox", "scheduling"),
                            ("schedule", "scheduling"), ("publish_stats", "scheduling"),
                            ("overlap_step", "scheduling"), ("run_ahead", "scheduling"),
                            ("idle_wait", "idle"), ("dispatch_step", "packing"),
                            ("run_batch", "bookkeeping"), ("land", "bookkeeping"),
                            ("launch", "bookkeeping"), ("process_new_token", "bookkeeping"),
                            ("land_decode_rows", "bookkeeping"),
                            ("finish_request", "bookkeeping"), ("emit", "emit"),
                            ("flush_outputs", "emit")):
            p.wrap(s, name, group)
        p.wrap(r, "forward", "packing")  # its own time: validating the chunks
        p.wrap(model_runner, "prepare_step", "packing")
        p.wrap(r, "_device_inputs", "transfer")
        p.wrap(s.tokenizer, "decode", "detokenize")
        p.wrap(native_routes, "generate_result", "format")
        p.wrap(native_routes, "sse", "json")
    p.wrap(r._programs, "run", "dispatch")
    p.wrap(s.sampler, "dispatch", "dispatch")
    wait = p.wrapped(lambda pending: jax.block_until_ready(pending.out), "device wait")
    result = PendingSample.result

    def read(pending):
        wait(pending)
        return result(pending)

    p._undo.append((PendingSample, "result", result))
    PendingSample.result = p.wrapped(read, "readback")
    return p


# ---------------------------------------------------------------------------- measurements
def device_times(server: Server, batch: int, context: int, reps: int = 10) -> list[float]:
    """ms of one decode step's programs alone (layer(s), head, sampler) for `batch` one-token
    chunks at `context` tokens, inputs already on the device, `reps` times. Runs while the
    scheduler is idle, after /flush_cache: every page is free (nothing is allocated; what is
    written there is never read)."""
    import httpx
    import jax

    from pdtopo.runtime.engine.model_runner import SeqChunk
    from pdtopo.runtime.engine.sampling import RowParams
    from pdtopo.runtime.engine.step_inputs import prepare_step

    s, r = server.scheduler, server.runner
    httpx.post(f"{server.url}/flush_cache", timeout=30).raise_for_status()
    assert not s.has_work() and not s.reqs and s.allocator.num_free == r.num_pages - 1
    per = -(-(context + 1) // r.page_size)
    assert batch * per < r.num_pages
    chunks = [SeqChunk([1 + i], context, list(range(1 + i * per, 1 + (i + 1) * per)))
              for i in range(batch)]
    step = prepare_step(chunks, r.geometry)
    inputs = r._device_inputs(step)
    rows = [RowParams(0.0, -1, 1.0, 0, 0)] * batch
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        with r._lock:
            logits, r.kv_caches = r._programs.run(step.key, r.params, r.kv_caches, *inputs)
        jax.block_until_ready(s.sampler.dispatch(logits, rows).out)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _window(records: list[tuple], batch: int) -> tuple[tuple, tuple] | None:
    """First and last record of the longest stretch in which `batch` requests ran and none
    waited (the steady decode window)."""
    best, start = None, None
    for i, rec in enumerate(records + [None]):
        ok = rec is not None and rec[3] == batch and rec[4] == 0
        if ok and start is None:
            start = i
        if not ok and start is not None:
            if best is None or i - 1 - start > best[1] - best[0]:
                best = (start, i - 1)
            start = None
    if best is None or records[best[1]][1] - records[best[0]][1] < 2:
        return None
    return records[best[0]], records[best[1]]


def per_step(a: tuple, b: tuple) -> dict:
    steps = b[1] - a[1]
    out = {"steps": steps, "wall": (b[0] - a[0]) / steps * 1e3,
           "tok_s": (b[2] - a[2]) / (b[0] - a[0]), "overlapped": (b[5] - a[5]) / steps,
           "sched_cpu": (b[6] - a[6]) / steps * 1e3, "http_cpu": (b[7] - a[7]) / steps * 1e3,
           "proc_cpu": (b[8] - a[8]) / steps * 1e3,
           "running": a[3], "waiting": a[4]}
    if a[9] is not None:
        for name, i in (("by_wall", 0), ("by_cpu", 1)):
            x, y = a[9][i], b[9][i]
            out[name] = {k: (y.get(k, 0.0) - x.get(k, 0.0)) / steps * 1e3 for k in set(x) | set(y)}
        # the scheduler thread's time in the step programs: launched, then waited for
        out["device_loop"] = sum(out["by_wall"].get(("sched", g), 0.0)
                                 for g in ("dispatch", "device wait"))
    return out


def decode_run(server: Server, batch: int, tokens: int, overlap: bool,
               profile: bool = False) -> dict | None:
    s = server.scheduler
    s.overlap = overlap
    p = server.recorder.profile = install_profile(server, full=profile)
    server.recorder.start()
    try:
        client = run_clients(server.url, batch, batch, (tokens, tokens))
    finally:
        records = server.recorder.stop()
        server.recorder.profile = None
        p.remove()
    if client["errors"] or client["requests"] != batch:
        raise RuntimeError(f"batch {batch}: {client}")
    if tokens < 8:  # a warm-up pass
        return None
    win = _window(records, batch)
    if win is None:
        raise RuntimeError(f"batch {batch}: no step with all {batch} requests running")
    out = per_step(*win)
    out["client_cpu"] = client["cpu_s"] / max(1, records[-1][1] - records[0][1]) * 1e3
    return out


def backlog_run(server: Server, clients: int, tokens: tuple[int, int], overlap: bool,
                ramp_s: float, measure_s: float) -> dict:
    s = server.scheduler
    s.overlap = overlap
    p = server.recorder.profile = install_profile(server, full=False)
    server.recorder.start()
    t0 = time.perf_counter()
    try:
        run_clients(server.url, clients, 1 << 30, tokens, seconds=ramp_s + measure_s, seed=1)
    finally:
        records = server.recorder.stop()
        server.recorder.profile = None
        p.remove()
    inside = [r for r in records if t0 + ramp_s <= r[0] <= t0 + ramp_s + measure_s]
    a, b = inside[0], inside[-1]
    out = per_step(a, b)
    out["waiting_mean"] = statistics.mean(r[4] for r in inside)
    out["running_mean"] = statistics.mean(r[3] for r in inside)
    out["waiting_min"] = min(r[4] for r in inside)
    out["steps_s"] = (b[1] - a[1]) / (b[0] - a[0])
    deadline = time.monotonic() + 60
    while s.has_work() and time.monotonic() < deadline:  # the dropped streams are aborted
        time.sleep(0.05)
    return out


# ---------------------------------------------------------------------------- report
SCHED_ROWS = [
    ("scheduling", "scheduling (inbox, schedule, stats, overlap's run_ahead)"),
    ("packing", "input packing (prepare_step, chunks, sampler rows)"),
    ("transfer", "transfer (one host->device put + unpack)"),
    ("readback", "readback (device_get once the step is ready)"),
    ("bookkeeping", "per-token bookkeeping (land_decode_rows, stops, finish)"),
    ("emit", "emit (ReqOutput; held, to the sinks before the wait)"),
    ("detokenize", "detokenization (stop strings)"),
    ("loop", "loop glue (step())"),
]
HTTP_ROWS = [
    ("detokenize", "detokenization (TextView.visible: tokenizer.decode)"),
    ("format", "formatting (generate_result: ids, meta_info)"),
    ("json", "JSON + SSE framing (sse)"),
]
LABEL = 58


def _row(label: str, cells: list[str]) -> str:
    return f"    {label:<{LABEL}}" + "".join(f"{c:>17}" for c in cells)


def _pair(wall: float, cpu: float) -> str:
    return f"{wall:.2f} / {cpu:.2f}"


def _get(run: dict, clock: str, thread: str, group: str) -> float:
    return run[f"by_{clock}"].get((thread, group), 0.0)


def ceiling(device_ms: float, host_ms: float, batch: int) -> str:
    """What overlap can give at all with these measured times: hiding the host part entirely
    turns a step of device + host into one of max(device, host), so the speed-up is at most
    (device + host) / max(device, host). Beside it, arithmetic and no measurement: a host
    part within HOST_GOAL_MS gives OVERLAP_GOAL only on a device step of at most
    HOST_GOAL_MS / (OVERLAP_GOAL - 1) ms."""
    slower = max(device_ms, host_ms, 1e-9)
    need = HOST_GOAL_MS / (OVERLAP_GOAL - 1.0)
    return (f"  ceiling at batch {batch}: overlap gives at most (device + host) / max(device, "
            f"host) = ({device_ms:.2f} + {host_ms:.2f}) / {slower:.2f} = "
            f"{(device_ms + host_ms) / slower:.2f}x (all of the host part hidden); host <= "
            f"{HOST_GOAL_MS:.1f} ms and overlap >= {OVERLAP_GOAL:.1f}x hold together only where "
            f"the device step takes <= {need:.2f} ms (here {device_ms:.2f} ms)")


def report(batches: list[int], tokens: int, dev: dict, off: dict, on: dict, prof: dict,
           back: dict, back_spec: str, header: str) -> str:
    lines = [header]
    lines.append(f"  {'batch':>5} {'device ms':>10} {'in loop':>8} {'wall ms off':>12} "
                 f"{'wall ms on':>11} {'host ms':>8} {'on path':>8} {'overlap':>8} "
                 f"{'tok/s off':>10} {'tok/s on':>9} {'steps':>6}")
    for b in batches:
        host = off[b]["wall"] - dev[b]
        path = off[b]["wall"] - off[b]["device_loop"]
        lines.append(f"  {b:>5} {dev[b]:>10.2f} {off[b]['device_loop']:>8.2f} "
                     f"{off[b]['wall']:>12.2f} {on[b]['wall']:>11.2f} {host:>8.2f} {path:>8.2f} "
                     f"{off[b]['wall'] / on[b]['wall']:>7.2f}x {off[b]['tok_s']:>10.0f} "
                     f"{on[b]['tok_s']:>9.0f} {off[b]['steps']:>6}")
    lines.append("  (device ms: the step programs alone, timed apart; in loop: the scheduler "
                 "thread's time launching and waiting for them, overlap off; host ms = wall - "
                 "device, overlap off; on path = wall - in loop: the host's own part, without "
                 "the device's slowdown by the host's threads on this machine's CPUs; steps: the "
                 f"decode window's, {tokens} tokens a request; overlapped with overlap on: "
                 + ", ".join(f"{on[b]['overlapped']:.0%} at {b}" for b in batches) + ")")
    lines.append(_row("where the host time goes (overlap off, hooked run), ms per "
                      "step", [f"batch {b}" for b in batches]))
    lines.append(_row("wall per step: hooked run / plain run",
                      [f"{prof[b]['wall']:.2f} / {off[b]['wall']:.2f}" for b in batches]))
    lines.append("   scheduler thread, wall / CPU in:")
    for key, label in SCHED_ROWS:
        lines.append(_row(label, [_pair(_get(prof[b], "wall", "sched", key),
                                        _get(prof[b], "cpu", "sched", key)) for b in batches]))
    host_wall = {b: sum(_get(prof[b], "wall", "sched", k) for k, _ in SCHED_ROWS)
                 for b in batches}
    host_cpu = {b: sum(_get(prof[b], "cpu", "sched", k) for k, _ in SCHED_ROWS)
                for b in batches}
    lines.append(_row("  sum: the scheduler's host work", [_pair(host_wall[b], host_cpu[b])
                                                           for b in batches]))
    dw = {b: _get(prof[b], "wall", "sched", "dispatch") + _get(prof[b], "wall", "sched",
                                                               "device wait") for b in batches}
    dc = {b: _get(prof[b], "cpu", "sched", "dispatch") + _get(prof[b], "cpu", "sched",
                                                              "device wait") for b in batches}
    lines.append(_row("dispatch + wait for the step (the device's time)",
                      [_pair(dw[b], dc[b]) for b in batches]))
    lines.append(_row("  minus the device time apart: launch, GIL, CPU share",
                      [f"{dw[b] - dev[b]:.2f}" for b in batches]))
    lines.append(_row("host ms of the hooked run (wall - device time apart)",
                      [f"{prof[b]['wall'] - dev[b]:.2f}" for b in batches]))
    lines.append(_row("  of it, the host rows' GIL waits (their wall - CPU)",
                      [f"{host_wall[b] - host_cpu[b]:.2f}" for b in batches]))
    lines.append("   HTTP event-loop thread (same process, same GIL), wall / CPU in:")
    lines.append(_row("whole thread (CPU)", [f"{prof[b]['http_cpu']:.2f}" for b in batches]))
    for key, label in HTTP_ROWS:
        lines.append(_row(label, [_pair(_get(prof[b], "wall", "http", key),
                                        _get(prof[b], "cpu", "http", key)) for b in batches]))
    rest = [prof[b]["http_cpu"] - sum(_get(prof[b], "cpu", "http", k) for k, _ in HTTP_ROWS)
            for b in batches]
    lines.append(_row("rest: asyncio, uvicorn/h11, queues (CPU, by difference)",
                      [f"{x:.2f}" for x in rest]))
    lines.append(_row("process CPU (both threads + XLA's)", [f"{prof[b]['proc_cpu']:.2f}"
                                                            for b in batches]))
    lines.append(_row("client process CPU (HTTP client, JSON parsing)",
                      [f"{prof[b]['client_cpu']:.2f}" for b in batches]))
    cpus = len(os.sched_getaffinity(0))
    lines.append(_row(f"all of it over the {cpus} CPUs (the wall if CPU-bound)",
                      [f"{(prof[b]['proc_cpu'] + prof[b]['client_cpu']) / cpus:.2f}"
                       for b in batches]))
    o, f = back[True], back[False]
    ratio = o["steps_s"] / f["steps_s"]
    lines.append(f"  backlog ({back_spec}): steps/s off {f['steps_s']:.2f}, on {o['steps_s']:.2f} "
                 f"({ratio:.2f}x); tokens/s off {f['tok_s']:.0f}, on {o['tok_s']:.0f} "
                 f"({o['tok_s'] / f['tok_s']:.2f}x); running {f['running_mean']:.0f}/"
                 f"{o['running_mean']:.0f}, waiting {f['waiting_mean']:.0f}/"
                 f"{o['waiting_mean']:.0f} (min {min(f['waiting_min'], o['waiting_min'])}) on "
                 f"average; steps overlapped with overlap on: {o['overlapped']:.0%}")
    b = 256 if 256 in batches else batches[-1]
    host = off[b]["wall"] - dev[b]
    lines.append(ceiling(dev[b], host, b))
    lines.append(f"host ms per decode step at batch {b} = {host:.2f}; "
                 f"overlap under backlog = {ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per request")
    ap.add_argument("--backlog-clients", type=int, default=320)
    ap.add_argument("--backlog-tokens", default="64,256")
    ap.add_argument("--backlog-seconds", type=float, default=20.0)
    ap.add_argument("--backlog-ramp", type=float, default=6.0)
    ap.add_argument("overrides", nargs="*", help="hydra overrides for the server")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    back_tokens = tuple(int(x) for x in args.backlog_tokens.split(","))

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    t_start = time.perf_counter()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_host_step_") as tmp:
        model = write_model(Path(tmp) / "model")
        server = Server([f"model.path={model}", *args.overrides])
        try:
            eng = server.cfg.engine
            if max(batches) > eng.max_running_requests:
                raise SystemExit(f"batch {max(batches)} > engine.max_running_requests")
            for overlap in (True, False):  # a first pass runs every path once
                decode_run(server, max(batches), 4, overlap)
                decode_run(server, 1, 4, overlap)
            setup_s = time.perf_counter() - t_start
            context = PROMPT_LEN + args.tokens // 2  # the decode window's middle
            dev, off, on, prof = {}, {}, {}, {}
            for b in batches:  # device time before and after the batch's runs, pooled
                times = device_times(server, b, context)
                off[b] = decode_run(server, b, args.tokens, overlap=False)
                on[b] = decode_run(server, b, args.tokens, overlap=True)
                prof[b] = decode_run(server, b, args.tokens, overlap=False, profile=True)
                dev[b] = statistics.median(times + device_times(server, b, context))
            back = {overlap: backlog_run(server, args.backlog_clients, back_tokens, overlap,
                                         args.backlog_ramp, args.backlog_seconds)
                    for overlap in (False, True)}
            server.scheduler.overlap = bool(eng.overlap_schedule)
        finally:
            server.stop()
    m = server.runner.config
    client = "aiohttp" if importlib.util.find_spec("aiohttp") else "httpx"
    header = (f"host step benchmark: 1 layer, hidden {m.hidden_size}, vocab {m.vocab_size} "
              f"(byte-level BPE tokenizer of {VOCAB} ids), backend={jax.default_backend()}, "
              f"{len(os.sched_getaffinity(0))} CPUs, load average {load:.2f} at start, "
              f"{os.getloadavg()[0]:.2f} at the end; in-process uvicorn + /generate SSE to "
              f"{client} clients in a subprocess; {PROMPT_LEN}-token prompts, "
              f"greedy, ignore_eos; setup+warmup {setup_s:.0f}s, total "
              f"{time.perf_counter() - t_start:.0f}s")
    spec = (f"{args.backlog_clients} clients, max_running_requests {eng.max_running_requests}, "
            f"{back_tokens[0]}..{back_tokens[1]} tokens, {args.backlog_seconds:.0f}s after "
            f"{args.backlog_ramp:.0f}s")
    print(report(batches, args.tokens, dev, off, on, prof, back, spec, header))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        sys.exit(client_main(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
