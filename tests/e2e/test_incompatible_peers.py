"""Incompatible P and D and a P-only rejection, real processes.

One bootstrap server and one decode server D, plus one prefill server per mismatch, each
started directly (`python -m pdtopo.runtime.server --run-dir RUN --process NAME`) from a
hand-made run dir: every P shares the plan (one plan.json, like a launcher run) but reads its
own config.yaml, differing from D's in exactly one thing:

    prefill_page   topology.prefill.engine.page_size=8    (per-role override, D has 16)
    prefill_dtype  topology.prefill.engine.kv_dtype=bfloat16  (per-role override)
    prefill_model  model.init_seed=99   (other weights: another model identity)
    prefill_tp2    mesh tp=2            (KV pool sharded over 2 devices, D has 1)
    prefill_short  engine.max_model_len=64  (compatible KV; rejects prompts D accepts)

Each request is sent the way sglang-router sends it: the same body to P and D at once with
bootstrap_host/port (P's side channel) and bootstrap_room. A mismatch must end D's request at
once with an error naming the mismatch (never a hang, never decoded from foreign KV), and
every pool returns to its baseline. prefill_short's rejection of a too-long prompt must reach
D over the side channel as the same 400 (D alone would have accepted it).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.launcher.render.run_dir import resolved_config
from pdtopo.runtime.settings import TOKEN_ENV
from tests.support.e2e import (
    REPO_ROOT,
    pool_state,
    port_block,
    wait_healthy,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

# small batch and prefill budgets: few shapes to compile at warmup (6 servers start at once)
BASE = ["model=tiny_llama", "model.num_layers=2",
        "disaggregation.kv_timeout_s=20", "engine.num_pages=64",
        "engine.max_running_requests=2", "engine.max_prefill_tokens=64"]
TOKEN = "incompatible-peers-token"
VARIANTS = {
    "prefill_page": ({"topology.prefill.engine.page_size": 8}, 1),
    "prefill_dtype": ({"topology.prefill.engine.kv_dtype": "bfloat16"}, 1),
    "prefill_model": ({"model.init_seed": 99}, 1),
    "prefill_tp2": ({}, 2),
    "prefill_short": ({"engine.max_model_len": 64}, 1),
}
EXPECTED = {
    "prefill_page": ["page_size: this server has 16, peer has 8"],
    "prefill_dtype": ["kv_dtype: this server has 'float32', peer has 'bfloat16'"],
    "prefill_model": ["model:", "seed=1234", "seed=99"],
}


def _entry(name: str, role: str, tp: int, ports: dict[str, int], run_dir: Path) -> dict:
    return {
        "name": name, "role": role, "host": "localhost", "address": "127.0.0.1",
        "instance_id": name,
        "rank": {"tp_rank": 0, "tp_size": tp, "cp_rank": 0, "cp_size": 1, "dp_rank": 0,
                 "dp_size": 1, "pp_rank": 0, "pp_size": 1},
        "chips": list(range(tp)), "mesh": {"tp": tp}, "ports": ports,
        "env": {"JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}"},
        "command": [sys.executable, "-m", "pdtopo.runtime.server", "--run-dir", str(run_dir),
                    "--process", name],
        "health_url": f"http://127.0.0.1:{ports['http']}/health", "priority": 200,
        "cpu_affinity": None,
    }


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        base = port_block(3 * (len(VARIANTS) + 1) + 1)
        self.boot_port = base
        names = ["decode_0", *VARIANTS]
        self.ports = {n: {"http": base + 1 + i, "transfer": base + 1 + len(names) + i,
                          "zmq": base + 1 + 2 * len(names) + i} for i, n in enumerate(names)}
        self.run_dirs = {n: root / n for n in names}
        plan = {"topology": "hand_made", "mode": "pd", "platform": "cpu", "accelerator": "cpu-8",
                "bootstrap_url": f"http://127.0.0.1:{base}", "proxy_url": None,
                "processes": [
                    {**_entry("bootstrap", "bootstrap", 1, {"http": base}, root / "decode_0"),
                     "chips": [], "mesh": {}},
                    _entry("decode_0", "decode", 1, self.ports["decode_0"], root / "decode_0"),
                    *[_entry(n, "prefill", tp, self.ports[n], self.run_dirs[n])
                      for n, (_, tp) in VARIANTS.items()]]}
        self.plan = plan
        base_cfg = compose_config(BASE)
        for name, run in self.run_dirs.items():
            cfg = base_cfg.copy()
            for key, value in VARIANTS.get(name, ({}, 1))[0].items():
                OmegaConf.update(cfg, key, value, force_add=True)
            run.mkdir(parents=True)
            (run / "config.yaml").write_text(resolved_config(cfg))
            (run / "plan.json").write_text(json.dumps(plan))
        self.procs: dict[str, subprocess.Popen] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]['http']}"

    def start(self, name: str, module: str, run_dir: Path, tp: int = 1) -> None:
        env = {**os.environ, TOKEN_ENV: TOKEN, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}"}
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, "--run-dir", str(run_dir), "--process", name],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.root.glob("*.log")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("incompatible"))
    try:
        c.start("bootstrap", "pdtopo.runtime.bootstrap", c.run_dirs["decode_0"])
        wait_healthy(f"http://127.0.0.1:{c.boot_port}", 60, c.procs["bootstrap"])
        c.start("decode_0", "pdtopo.runtime.server", c.run_dirs["decode_0"])
        for name, (_, tp) in VARIANTS.items():
            c.start(name, "pdtopo.runtime.server", c.run_dirs[name], tp)
        for name in ["decode_0", *VARIANTS]:
            wait_healthy(c.url(name), 300, c.procs[name])
        yield c
    except Exception:
        c.stop()
        raise RuntimeError("cluster failed to start:\n" + c.logs()) from None
    c.stop()
    left = [n for n, p in c.procs.items() if p.poll() is None]
    assert not left, f"still running: {left}"


def _pd(cluster: Cluster, prefill: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """What the router does: the same body to P and D at once, with the bootstrap fields."""
    body = {**body, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": cluster.ports[prefill]["zmq"],
            "bootstrap_room": random.randrange(2**62)}
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(httpx.post, f"{cluster.url('decode_0')}/generate", json=body, timeout=60)
        fp = ex.submit(httpx.post, f"{cluster.url(prefill)}/generate", json=body, timeout=60)
        return fp.result(), fd.result()


def _baseline(cluster: Cluster, names) -> None:
    wait_pools_baseline({n: cluster.url(n) for n in names})


def test_per_role_engine_overrides_apply_in_each_process(cluster):
    info = {n: httpx.get(f"{cluster.url(n)}/get_server_info").json()
            for n in ("decode_0", "prefill_page", "prefill_dtype")}
    assert info["decode_0"]["page_size"] == 16 and info["decode_0"]["kv_dtype"] == "float32"
    assert info["prefill_page"]["page_size"] == 8
    assert info["prefill_dtype"]["kv_dtype"] == "bfloat16"


@pytest.mark.parametrize("prefill", sorted(EXPECTED))
def test_mismatch_is_a_clear_error_and_pools_return(cluster, prefill):
    before = pool_state(cluster.url("decode_0"))
    t0 = time.monotonic()
    _, rd = _pd(cluster, prefill, {"text": "Tell me about KV caches",
                                   "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    took = time.monotonic() - t0
    assert rd.status_code >= 400, rd.text
    msg = rd.json()["error"]["message"]
    assert "incompatible" in msg and prefill in msg, msg
    for text in EXPECTED[prefill]:
        assert text in msg, (text, msg)
    assert took < 10, f"the mismatch took {took:.1f}s to report"
    _baseline(cluster, ["decode_0", prefill])
    after = pool_state(cluster.url("decode_0"))
    assert after["num_generated"] == before["num_generated"], "D decoded from foreign KV"


def test_a_prefill_with_another_tp_serves_the_same_tokens(cluster):
    """P tp=2 -> D tp=1 is a reshard, not a mismatch: D pulls P's two head shards, joins them,
    and decodes the tokens a tp=1 P gives; it pulls exactly its pool's share of the pages."""
    body = {"input_ids": [(7 * i) % 250 + 3 for i in range(40)],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    rp1, rd1 = _pd(cluster, "prefill_short", body)  # a tp=1 P of the same model
    before = pool_state(cluster.url("decode_0"))["pd_pulled_bytes"]
    rp2, rd2 = _pd(cluster, "prefill_tp2", body)
    assert rp2.status_code == 200 and rd2.status_code == 200, (rp2.text, rd2.text)
    assert rd2.json()["output_ids"] == rd1.json()["output_ids"]
    assert len(rd2.json()["output_ids"]) == 8
    pulled = pool_state(cluster.url("decode_0"))["pd_pulled_bytes"] - before
    # 40 tokens = 3 pages of 16, moved as the wire's 8 rows; 4 KV heads of 16 floats;
    # 2 layers x (k, v)
    assert pulled == 8 * 16 * 4 * 16 * 4 * 4, pulled
    _baseline(cluster, ["decode_0", "prefill_tp2"])


def test_prefill_only_rejection_reaches_decode_over_side_channel(cluster):
    # 100 tokens: fine for D (max_model_len 1024), too long for prefill_short (64)
    body = {"input_ids": [7] * 100, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    before = pool_state(cluster.url("decode_0"))
    t0 = time.monotonic()
    rp, rd = _pd(cluster, "prefill_short", body)
    took = time.monotonic() - t0
    assert rp.status_code == 400 and "max_model_len=64" in rp.text, rp.text
    assert rd.status_code == 400, rd.text
    assert "rejected by the prefill server" in rd.text and "max_model_len=64" in rd.text
    assert took < 5, f"D learned of P's rejection after {took:.1f}s (kv_timeout_s is 20)"
    _baseline(cluster, ["decode_0", "prefill_short"])
    assert pool_state(cluster.url("decode_0"))["num_generated"] == before["num_generated"]


def test_decode_still_serves_with_a_compatible_prefill(cluster):
    body = {"input_ids": [7] * 20, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                       "ignore_eos": True}}
    rp, rd = _pd(cluster, "prefill_short", body)
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    assert len(rd.json()["output_ids"]) == 6
    assert rd.json()["output_ids"][0] == rp.json()["output_ids"][0]
    _baseline(cluster, ["decode_0", "prefill_short"])
