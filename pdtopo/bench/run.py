"""One benchmark run against a URL: workload -> warmup -> load -> statistics -> metrics dict.

`run_bench(url, settings)` returns `{"url", "settings", "stats", "started_at"}` (stats from
`stats.summarize`). `wait_serving(url)` retries one tiny generate until it succeeds: a router's
/health is 200 before it has registered its workers. `default_url(run_dir)` is the URL `pdtopo bench` uses when given none: the
run's proxy, or its colocated (or local) server when the topology has no proxy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from pdtopo.bench import stats
from pdtopo.bench.loadgen import auth_headers, run_chat, run_conversations, run_load
from pdtopo.bench.settings import BenchSettings
from pdtopo.bench.workload import (
    build_workload,
    chat_conversations,
    multiturn,
    warmup_workload,
)


def default_url(run_dir: Path) -> str:
    plan = json.loads((Path(run_dir) / "plan.json").read_text())
    return url_of_plan(plan)


def url_of_plan(plan: dict) -> str:
    if plan.get("proxy_url"):
        return plan["proxy_url"]
    for proc in plan["processes"]:
        if proc["role"] in ("colocated", "local"):
            return f"http://{proc['address']}:{proc['ports']['http']}"
    raise ValueError(f"plan of {plan.get('topology')!r} has neither a proxy nor a server to bench")


def wait_serving(url: str, timeout_s: float = 120.0, poll_s: float = 0.25,
                 api_key: str | None = None) -> float:
    """Block until `url` completes a 1-token /generate; returns the seconds waited."""
    t0 = time.perf_counter()
    body = {"input_ids": [65, 66], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    last = ""
    with httpx.Client(timeout=30.0, headers=auth_headers(api_key)) as client:
        while True:
            try:
                resp = client.post(f"{url.rstrip('/')}/generate", json=body)
                if resp.status_code == 200:
                    return time.perf_counter() - t0
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{url} did not serve a request within {timeout_s:g} s "
                                   f"(last: {last})")
            time.sleep(poll_s)


def run_bench(url: str, settings: BenchSettings, *, workload=None, progress: bool | None = None,
              offsets: list[float] | None = None, api_key: str | None = None) -> dict:
    """`api_key`: the proxy's API key, sent as `Authorization: Bearer` (never recorded)."""
    conversations = chats = None
    if workload is None and settings.workload == "multiturn":
        conversations = multiturn(settings)
    elif workload is None and settings.workload == "chat":
        chats = chat_conversations(settings)
    elif workload is None:
        workload = build_workload(settings)
    warm = warmup_workload(settings)
    if warm:
        warm_settings = BenchSettings(**{**settings.__dict__, "max_concurrency": 1,
                                         "request_rate": float("inf")})
        run_load(url, warm, warm_settings, progress=False, api_key=api_key)
    started = time.time()
    if chats is not None:
        results, duration = run_chat(url, chats, settings, progress=progress, api_key=api_key)
    elif conversations is not None:
        results, duration = run_conversations(url, conversations, settings, progress=progress,
                                              api_key=api_key)
    else:
        results, duration = run_load(url, workload, settings, progress=progress,
                                     offsets=offsets, api_key=api_key)
    return {
        "url": url,
        "started_at": started,
        "settings": settings.to_dict(),
        "stats": stats.summarize(results, duration, settings.slo),
    }
