"""Heterogeneous PD end to end: `pdtopo launch topology=1p2d_cpu_hetero` (one prefill instance
of tp=2 feeding two decode instances of tp=1, under supervisord, behind sglang-router). Greedy
outputs through the proxy equal a colocated tp=1 server for short and long prompts, one at a
time and many at once; each D pulled KV (the reshard ran on both); pools return to baseline and
`pdtopo stop` leaves nothing behind."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from tests.support.constants import TWO_LAYERS, greedy
from tests.support.e2e import (
    Deployment,
    colocated_reference,
    deployment_overrides,
    generate,
    pool_state,
    port_block,
    wait_pools_baseline,
)

pytestmark = pytest.mark.slow

GREEDY = greedy(10, ignore_eos=True)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "A long prompt that spans many KV pages of sixteen tokens each, so that the prefill "
    "server cuts scattered pages into pieces for each decode shard and the decode server "
    "joins them back before scattering: " * 3,
    *[f"Request number {i} asks about resharding KV heads between meshes." for i in range(9)],
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with colocated_reference(tmp_path_factory.mktemp("colocated"), TWO_LAYERS, PROMPTS,
                             GREEDY) as ref:
        yield ref


@pytest.fixture(scope="module")
def hetero(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hetero") / "run"
    dep = Deployment(run_dir, ["topology=1p2d_cpu_hetero", *TWO_LAYERS,
                               *deployment_overrides(port_block(40))])
    try:
        dep.launch()
        yield dep
    finally:
        dep.stop_and_check()


def test_plan_gives_each_role_its_own_tp(hetero):
    meshes = {p["name"]: p["mesh"]["tp"] for p in hetero.plan["processes"]
              if p["role"] in ("prefill", "decode")}
    assert meshes == {"prefill_0": 2, "decode_0": 1, "decode_1": 1}


def test_outputs_match_colocated_one_by_one_and_all_at_once(hetero, reference):
    for prompt in PROMPTS[:3]:
        out = generate(hetero.proxy_url, {"text": prompt, "sampling_params": GREEDY})
        assert out["output_ids"] == reference[prompt], prompt
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: generate(hetero.proxy_url,
                                                {"text": p, "sampling_params": GREEDY}),
                             PROMPTS))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == reference[prompt], prompt
    wait_pools_baseline(hetero)
    states = {n: pool_state(hetero.url(n)) for n in ("prefill_0", "decode_0", "decode_1")}
    assert states["decode_0"]["pd_pulled_bytes"] > 0 and states["decode_1"]["pd_pulled_bytes"] > 0
    assert states["prefill_0"]["pd_registered_kv"] == 0
