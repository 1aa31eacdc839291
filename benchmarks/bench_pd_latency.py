"""PD overhead at concurrency 1: a colocated server vs 1P1D through each sglang-router proxy.

One command: `python benchmarks/bench_pd_latency.py [--requests N] [--max-new-tokens M]
[--proxies rust,rust-nagle,gateway,mini_lb] [--no-openai]`.
It starts a colocated server (the baseline, measured in the same run) and then 1p1d_cpu
deployments behind each proxy (the Rust router, the gateway, MiniLB; `pdtopo launch --detach`),
sends the same prompts one at a time, on one reused keep-alive connection and on a new
connection per request, and prints per server and connection mode:
- TTFT of a streaming request (first SSE event at the client) and its end-to-end time;
- the latency of a non-streaming 1-token request (prefill + hand-off + one answer: the
  time to first token as a non-streaming client sees it);
then the PD overhead (PD - colocated) at p50 and p99. Goal: PD TTFT overhead <= 10 ms p50.

`rust-nagle` is the Rust router without pdtopo's accept wrapper (`proxy.client_nodelay=false`,
how it ran before): the wrapper's effect, measured in the same run. Unless `--no-openai`, the
same comparison runs a second time on a real-tokenizer checkpoint (written here with
pdtopo.model_config.random_checkpoint; nothing downloaded) through the OpenAI client's
streaming chat completions: one client for all requests (its pooled keep-alive connection) and
a new client per request. TTFT there is the first chunk with content.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from pdtopo.bench.deployments import (
    ColocatedProcess,
    DetachedDeployment,
    port_overrides,
)
from pdtopo.model_config.random_checkpoint import write_random_checkpoint
from pdtopo.ports import free_port_block

SERVED_MODEL = "hf-local"  # conf/model/hf_local.yaml: model.name

# proxy names this benchmark takes -> the launch overrides that select them
PROXY_OVERRIDES = {
    "rust": ["proxy=rust"],
    "rust-nagle": ["proxy=rust", "proxy.client_nodelay=false"],
    "gateway": ["proxy=gateway"],
    "mini_lb": ["proxy=mini_lb"],
}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _one_server(client: httpx.Client, url: str, prompt: str, max_new_tokens: int,
                out: dict[str, list[float]]) -> None:
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/generate", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter() - t0
    out["e2e"].append(time.perf_counter() - t0)
    out["ttft"].append(first if first is not None else out["e2e"][-1])
    one = {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    t0 = time.perf_counter()
    client.post(f"{url}/generate", json=one).raise_for_status()
    out["one_token"].append(time.perf_counter() - t0)


def _one_openai(client, prompt: str, max_new_tokens: int,
                out: dict[str, list[float]]) -> None:
    messages = [{"role": "user", "content": prompt}]
    model = SERVED_MODEL  # the gateway routes by model id: "default" finds no worker
    t0 = time.perf_counter()
    first = None
    stream = client.chat.completions.create(model=model, messages=messages, stream=True,
                                            max_tokens=max_new_tokens, temperature=0)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    out["e2e"].append(time.perf_counter() - t0)
    out["ttft"].append(first if first is not None else out["e2e"][-1])
    t0 = time.perf_counter()
    client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                   temperature=0)
    out["one_token"].append(time.perf_counter() - t0)


def measure_openai(url: str, prompts: list[str], max_new_tokens: int,
                   reuse: bool = True) -> dict[str, list[float]]:
    """The OpenAI client's chat completions; `reuse`: one client (one pooled connection)."""
    import openai  # deferred: the test extra's client; --no-openai runs without it

    return _each_prompt(
        lambda: openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120),
        lambda c, prompt, out: _one_openai(c, prompt, max_new_tokens, out), prompts, reuse)


def _each_prompt(new_client, one, prompts: list[str], reuse: bool) -> dict[str, list[float]]:
    """`one(client, prompt, out)` for every prompt, on one client (`reuse`: its keep-alive
    connection) or a new client per prompt."""
    out: dict[str, list[float]] = {"ttft": [], "e2e": [], "one_token": []}
    if reuse:
        with new_client() as c:
            for prompt in prompts:
                one(c, prompt, out)
    else:
        for prompt in prompts:
            with new_client() as c:
                one(c, prompt, out)
    return out


def measure(url: str, prompts: list[str], max_new_tokens: int,
            reuse: bool = True) -> dict[str, list[float]]:
    """`reuse`: every request on one keep-alive connection (what pooled clients such as the
    OpenAI client do); otherwise a new connection per request."""
    return _each_prompt(lambda: httpx.Client(timeout=120),
                        lambda c, prompt, out: _one_server(c, url, prompt, max_new_tokens, out),
                        prompts, reuse)


def run_all(tmp: Path, label: str, model: list[str], proxies: list[str], args,
            measure_fn) -> dict[str, dict[str, list[float]]]:
    """Colocated, then 1P1D behind each proxy, on `model`; results by '<server> <mode>'."""
    prompts = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)
               for i in range(args.requests + args.warmup)]
    results: dict[str, dict[str, list[float]]] = {}

    def run(name: str, url: str) -> None:
        measure_fn(url, prompts[: args.warmup], args.max_new_tokens)
        for mode, reuse in (("reused", True), ("new conn", False)):
            results[f"{name} {mode}"] = measure_fn(url, prompts[args.warmup:],
                                                   args.max_new_tokens, reuse)

    colo = ColocatedProcess(free_port_block(1), model,
                            log_path=tmp / f"colocated-{label}.log")
    try:
        colo.start()
        run("colocated", colo.url)
    finally:
        colo.stop()
    for proxy in proxies:
        dep = DetachedDeployment(tmp / f"run-{label}-{proxy}",
                                 [*PROXY_OVERRIDES[proxy], *model,
                                  *port_overrides(free_port_block(40))])
        try:
            t0 = time.perf_counter()
            dep.launch()
            print(f"[{label}] 1p1d_cpu {proxy} launched and healthy in "
                  f"{time.perf_counter() - t0:.1f}s")
            run(f"1P1D {proxy}", dep.proxy_url)
        finally:
            dep.stop()
    return results


def report(title: str, results: dict[str, dict[str, list[float]]], args) -> None:
    print(f"\n{title}: {args.requests} requests per server and connection mode at concurrency 1 "
          f"(times in ms): streaming with {args.max_new_tokens} new tokens, and non-streaming "
          "with 1 new token; 'reused': one keep-alive connection, 'new conn': one per request")
    print(f"{'server':<28}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p50':>10}{'E2E p99':>10}"
          f"{'1-tok p50':>11}{'1-tok p99':>11}")
    for name, r in results.items():
        print(f"{name:<28}" + "".join(
            f"{_pct(r[k], q) * 1e3:>{w}.1f}" for k, q, w in
            (("ttft", 50, 10), ("ttft", 99, 10), ("e2e", 50, 10), ("e2e", 99, 10),
             ("one_token", 50, 11), ("one_token", 99, 11))))
    print()
    for name, r in results.items():
        if name.startswith("colocated"):
            continue
        label_mode = "reused" if name.endswith("reused") else "new conn"
        base = results[f"colocated {label_mode}"]
        for key, label in (("ttft", "streaming TTFT"), ("one_token", "1-token latency")):
            o50 = (_pct(r[key], 50) - _pct(base[key], 50)) * 1e3
            o99 = (_pct(r[key], 99) - _pct(base[key], 99)) * 1e3
            ratio = _pct(r[key], 50) / _pct(base[key], 50)
            goal = "met" if o50 <= 10 else "NOT met"
            print(f"{name:<28} {label:<16} overhead p50 {o50:+7.1f} ms, p99 {o99:+7.1f} ms "
                  f"(p50 ratio {ratio:.2f}x vs colocated {label_mode}; goal p50 <= 10 ms: "
                  f"{goal})")
    for mode in ("reused", "new conn"):
        fixed, nagle = results.get(f"1P1D rust {mode}"), results.get(f"1P1D rust-nagle {mode}")
        if fixed and nagle:
            print(f"accept wrapper, {mode}: rust TTFT p50 {_pct(fixed['ttft'], 50) * 1e3:.1f} ms "
                  f"vs {_pct(nagle['ttft'], 50) * 1e3:.1f} ms without it (rust-nagle), ratio "
                  f"{_pct(fixed['ttft'], 50) / _pct(nagle['ttft'], 50):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--proxies", default="rust,rust-nagle,gateway,mini_lb",
                    help="comma-separated proxies to measure: " + ", ".join(PROXY_OVERRIDES))
    ap.add_argument("--no-openai", action="store_true",
                    help="skip the OpenAI-client run on a real-tokenizer checkpoint")
    args = ap.parse_args()
    proxies = [p.strip() for p in args.proxies.split(",") if p.strip()]
    unknown = [p for p in proxies if p not in PROXY_OVERRIDES]
    if unknown:
        ap.error(f"--proxies: unknown {', '.join(unknown)} (known: {', '.join(PROXY_OVERRIDES)})")

    with tempfile.TemporaryDirectory(prefix="pdtopo-bench-") as tmp_name:
        tmp = Path(tmp_name)
        tiny = run_all(tmp, "tiny", ["model=tiny_llama"], proxies, args, measure)
        chat = None
        if not args.no_openai:
            ckpt = tmp / "checkpoint"
            write_random_checkpoint(ckpt)
            chat = run_all(tmp, "openai", ["model=hf_local", f"model.path={ckpt}"], proxies,
                           args, measure_openai)
    report("/generate on the tiny model", tiny, args)
    if chat is not None:
        report("OpenAI client, chat completions on a real-tokenizer checkpoint", chat, args)


if __name__ == "__main__":
    main()
