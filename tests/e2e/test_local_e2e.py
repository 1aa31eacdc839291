"""Local (in-process) disaggregation end to end: `pdtopo launch --detach topology=local_cpu`
starts ONE supervised program that owns 8 emulated chips (prefill mesh 4, decode meshes 2 + 2).
Its greedy outputs must equal a colocated server's token for token, every engine's pool must
return to its baseline, and a crashed worker thread (fault injection) must end the process with
a non-zero status so that supervisord restarts it."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from pdtopo.launcher.operate.supervisor_control import Supervisor
from pdtopo.runtime.worker_threads import CRASH_EXIT_CODE
from tests.support.constants import greedy
from tests.support.e2e import (
    Deployment,
    colocated_reference,
    deployment_overrides,
    generate,
    port_block,
    wait_healthy,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

ENGINE = ["model=tiny_llama", "model.num_layers=2", "engine.num_pages=64", "engine.page_size=8",
          "engine.max_running_requests=4", "engine.max_prefill_tokens=64",
          "engine.max_model_len=256"]
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "A long prompt that spans many KV pages of eight tokens each, so that the prefill engine "
    "gathers scattered pages and a decode engine scatters them into its own pool: ",
]
GREEDY = greedy(12)


def _launch(tmp_path_factory, name: str, extra: list[str]) -> Deployment:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    return Deployment(run_dir, ["topology=local_cpu", *ENGINE, *extra,
                                *deployment_overrides(port_block(40))])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with colocated_reference(tmp_path_factory.mktemp("colocated"), ENGINE, PROMPTS,
                             GREEDY) as ref:
        yield ref


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    dep = _launch(tmp_path_factory, "local", [])
    try:
        dep.launch()
        yield dep
    finally:
        dep.stop_and_check()


def test_greedy_matches_colocated_and_pools_return(local, reference):
    (name,) = local.names("local")
    url = local.url(name)
    info = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "local"
    with cf.ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(lambda p: generate(url, {"text": p, "sampling_params": GREEDY}),
                           PROMPTS * 3))
    assert [o["output_ids"] for o in outs] == [reference[p] for p in PROMPTS * 3]
    _, states = wait_pools_baseline({name: url})
    st = states[name]
    engines = st["engines"]
    assert set(engines) == {"prefill_0", "decode_0", "decode_1"}
    assert st["total_pages"] == sum(e["total_pages"] for e in engines.values())
    assert st["free_pages"] + st["tree_pages"] == st["total_pages"]
    assert st["local_transfers"] == len(outs)
    assert engines["decode_0"]["admitted"] >= 1 and engines["decode_1"]["admitted"] >= 1
    assert st["alive"] is True


def test_crashed_worker_thread_exits_and_supervisord_restarts(tmp_path_factory):
    dep = _launch(tmp_path_factory, "local-fault", [
        "local.fault_inject_thread=decode_0", "local.fault_inject_after_steps=3"])
    try:
        dep.launch()
        (name,) = dep.names("local")
        url = dep.url(name)
        sv = Supervisor(dep.run_dir)
        state, pid = sv.states()[name]
        assert state == "RUNNING" and pid > 0
        with pytest.raises(httpx.HTTPError):  # the process dies under the request
            generate(url, {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 20,
                                                                    "temperature": 0}}, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            state, new_pid = sv.states().get(name, ("?", 0))
            if state == "RUNNING" and new_pid not in (0, pid):
                break
            assert time.monotonic() < deadline, f"{name} not restarted: {state} {new_pid}"
            time.sleep(0.3)
        sv_log = (dep.run_dir / "supervisord.log").read_text()
        assert f"exited: {name} (exit status {CRASH_EXIT_CODE}; not expected)" in sv_log
        prog_log = (dep.run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        assert "worker thread decode_0 crashed" in prog_log
        assert "InjectedCrash" in prog_log
        wait_healthy(url, timeout=180)
        out = generate(url, {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 2,
                                                                      "temperature": 0}})
        assert len(out["output_ids"]) == 2  # the restarted process serves again
    finally:
        dep.stop_and_check()


def test_two_kv_heads_on_the_tp4_prefill_mesh(tmp_path_factory):
    """A model with 2 KV heads on local_cpu's tp=4 prefill mesh (refused before KV-head
    replication): each KV head is repeated on 2 devices, and the greedy tokens equal a
    colocated tp=1 server's of the same model."""
    model = ["model.num_kv_heads=2"]
    prompts = PROMPTS[1:3]
    with colocated_reference(tmp_path_factory.mktemp("colocated_kv2"), [*ENGINE, *model],
                             prompts, GREEDY) as ref:
        dep = _launch(tmp_path_factory, "local_kv2", model)
        try:
            dep.launch()
            (name,) = dep.names("local")
            url = dep.url(name)
            for p in prompts:
                out = generate(url, {"text": p, "sampling_params": GREEDY})
                assert out["output_ids"] == ref[p], p
            engines = httpx.get(f"{url}/pdtopo/state", timeout=10).json()["engines"]
            assert set(engines) == {"prefill_0", "decode_0", "decode_1"}
        finally:
            dep.stop_and_check()
