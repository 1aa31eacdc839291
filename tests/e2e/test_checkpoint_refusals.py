"""Refuse, never guess: every config.json field that would change the model's math in a way
pdtopo does not implement is an error naming the file, key and value (`REFUSALS` walks the
list, in both config formats where RoPE is concerned); the launcher's pre-flight shows that
error and exits 2 before anything starts, for the config, the tensors and tp vs the heads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.hf import REFUSED
from pdtopo.model_config.random_checkpoint import write_random_checkpoint
from pdtopo.model_config.spec import model_config_from_cfg
from tests.support.e2e import run_pdtopo

BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
    "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
OLD = {k: v for k, v in BASE.items() if k != "rope_parameters"} | {"rope_theta": 1000.0}
QWEN2 = BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2}

# (case id, config.json, key named, value named)
REFUSALS = [
    ("yarn_current", BASE | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                                 "factor": 4.0}},
     "rope_parameters.rope_type", "yarn"),
    ("dynamic_old", OLD | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type", "dynamic"),
    ("longrope_old_type_key", OLD | {"rope_scaling": {"type": "longrope", "factor": 2.0}},
     "rope_scaling.rope_type", "longrope"),
    ("partial_rotary_in_rope", BASE | {"rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor", 0.5),
    ("partial_rotary_top_level", OLD | {"partial_rotary_factor": 0.25},
     "partial_rotary_factor", 0.25),
    ("rope_per_layer_type", BASE | {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention", {"rope_type": "default", "rope_theta": 1e4}),
    ("llama3_unknown_param", BASE | {"rope_parameters": LLAMA3 | {"beta_fast": 32}},
     "rope_parameters.beta_fast", 32),
    ("llama3_missing_factor", OLD | {"rope_scaling": {k: v for k, v in LLAMA3.items()
                                                      if k not in ("factor", "rope_theta")}},
     "rope_scaling.factor", None),
    ("linear_zero_factor", BASE | {"rope_parameters": {"rope_type": "linear",
                                                       "rope_theta": 1e4, "factor": 0}},
     "rope_parameters.factor", 0),
    ("theta_disagrees", BASE | {"rope_theta": 5000.0}, "rope_theta", 5000.0),
    ("both_formats_disagree", BASE | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("sliding_layer_types", BASE | {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types", ["sliding_attention"]),
    ("qwen2_sliding_window_on", QWEN2 | {"use_sliding_window": True, "max_window_layers": 1},
     "use_sliding_window", True),
    ("mistral_sliding_window", BASE | {"architectures": ["MistralForCausalLM"],
                                       "model_type": "mistral", "sliding_window": 4096},
     "sliding_window", 4096),
    ("activation", BASE | {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act",
     "gelu_pytorch_tanh"),
    ("architecture", BASE | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     "architectures", ["GPT2LMHeadModel"]),
    ("head_dim_not_int", BASE | {"head_dim": "8"}, "head_dim", "8"),
    ("heads_do_not_divide_hidden", {k: v for k, v in BASE.items() if k != "head_dim"}
     | {"num_attention_heads": 5}, "num_attention_heads", 5),
] + [(f"refused_{key}", BASE | {key: value}, key, value) for key, value in {
    "quantization_config": {"quant_method": "gptq", "bits": 4},
    "mlp_bias": True,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 64,
    "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1,
    "shared_expert_intermediate_size": 256,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "use_qk_norm": True, "qk_layernorm": True, "attention_chunk_size": 8192,
    "no_rope_layers": [1, 0], "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
    "attention_multiplier": 0.015625, "logits_scaling": 8.0, "logit_scale": 0.5,
}.items()]


def _write(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_every_refused_key_is_walked():
    walked = {key for _, _, key, _ in REFUSALS}
    assert set(REFUSED) <= walked, set(REFUSED) - walked


@pytest.mark.parametrize("config,key,value", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_unsupported_feature_is_refused_by_key_and_value(tmp_path, config, key, value):
    root = _write(tmp_path / "m", config)
    with pytest.raises(CheckpointError) as info:
        model_config_from_cfg({"path": str(root)})
    err = info.value
    assert (err.where, err.key, err.value) == (str(root / "config.json"), key, value)
    assert f"{key}={value!r}" in str(err) and str(root / "config.json") in str(err)


@pytest.mark.parametrize("config", [
    BASE,
    OLD,
    OLD | {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}},
    BASE | {"rope_parameters": LLAMA3},
    BASE | {"rope_theta": 1000.0, "rope_scaling": {"rope_type": "default"}},  # both, agreeing
    QWEN2,  # sliding_window given but switched off
    BASE | {"layer_types": ["full_attention"] * 2, "num_experts": 0, "logit_scale": 1.0,
            "quantization_config": None},
], ids=["current", "old", "old_llama3", "current_llama3", "both_agree", "qwen2_window_off",
        "neutral_values"])
def test_supported_configs_load(tmp_path, config):
    cfg = model_config_from_cfg({"path": str(_write(tmp_path / "m", config))})
    assert cfg.rope.theta == 1000.0 and cfg.head_dim == 8


def test_llama3_original_context_defaults_to_max_positions(tmp_path):
    rope = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    cfg = model_config_from_cfg({"path": str(_write(tmp_path / "m",
                                                     BASE | {"rope_parameters": rope}))})
    assert (cfg.rope.kind, cfg.rope.original_max_position_embeddings) == ("llama3", 256)


def test_group_value_that_contradicts_config_json_is_refused(tmp_path):
    root = _write(tmp_path / "m", BASE)
    with pytest.raises(CheckpointError, match=r"model.head_dim=16.*head_dim=8"):
        model_config_from_cfg({"path": str(root), "head_dim": 16})
    with pytest.raises(CheckpointError, match=r"model.architecture='qwen2'"):
        model_config_from_cfg({"path": str(root), "architecture": "qwen2"})
    with pytest.raises(CheckpointError, match=r"model.rope_theta=2.0"):
        model_config_from_cfg({"path": str(root), "rope_theta": 2.0})
    same = model_config_from_cfg({"path": str(root), "head_dim": 8, "num_layers": 2})
    assert same.num_layers == 2


# ------------------------------------------------------------------ launcher pre-flight


def _render(tmp_path: Path, *overrides: str):
    run = tmp_path / "run"
    topology = [] if any(o.startswith("topology=") for o in overrides) else [
        "topology=colocated_cpu"]
    res = run_pdtopo(["render", *topology, "launcher.compilation_cache_dir=null",
                      *overrides, f"hydra.run.dir={run}"], timeout=120)
    return res, run


def test_render_refuses_unsupported_checkpoint_naming_the_key(tmp_path):
    root = _write(tmp_path / "yarn", BASE | {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    res, run = _render(tmp_path, "model=hf_local", f"model.path={root}")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "model error" in res.stderr and "rope_parameters.rope_type='yarn'" in res.stderr
    assert not (run / "supervisord.conf").exists()


def test_launch_refuses_at_once_without_starting_anything(tmp_path):
    """The launch fails in seconds with the key named, not after the health timeout."""
    root = _write(tmp_path / "moe", BASE | {"num_local_experts": 8})
    run = tmp_path / "run"
    started = time.monotonic()
    res = run_pdtopo(["launch", "topology=colocated_cpu", "model=hf_local",
                      f"model.path={root}", "launcher.health_timeout_s=600",
                      f"hydra.run.dir={run}"], timeout=120)
    took = time.monotonic() - started
    assert res.returncode == 2, res.stdout + res.stderr
    assert "num_local_experts=8" in res.stderr and "mixture-of-experts" in res.stderr
    assert took < 60 and not (run / "supervisord.pid").exists()
    assert not (run / "logs").exists()


def test_preflight_checks_tensors_and_tp(tmp_path):
    root = tmp_path / "ckpt"
    write_random_checkpoint(root, "llama")  # 4 heads, 2 KV heads, FF 48
    ok, _ = _render(tmp_path / "a", "model=hf_local", f"model.path={root}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # a tensor config.json does not account for: an o_proj bias without attention_bias
    shard = next(root.glob("model-00001-*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)  # hidden
    save_file(tensors, str(shard))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.o_proj.bias"] = shard.name
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    res, _ = _render(tmp_path / "b", "model=hf_local", f"model.path={root}")
    assert res.returncode == 2 and "model.layers.0.self_attn.o_proj.bias" in res.stderr, \
        res.stderr



@pytest.mark.parametrize("overrides,key", [
    (["topology=colocated_cpu", "topology.accelerator=cpu-4",
      "topology.colocated.chips_per_instance=4", "topology.colocated.mesh.tp=4"],
     "topology.colocated.mesh.tp"),
    (["topology=local_cpu"], "topology.prefill_slices"),  # its prefill mesh is tp=4
])
def test_tp_that_cannot_split_the_model_fails_launch_and_warns_render(tmp_path, overrides, key):
    """tp=4 can neither split 3 KV heads nor repeat them evenly (the tiny random model with
    12 attention heads: no checkpoint involved). Fewer KV heads that divide tp are repeated
    and served (test_model_runner, test_local_e2e)."""
    run = tmp_path / "run"
    bad = ["model=tiny_llama", "model.num_kv_heads=3", "model.num_heads=12"]
    res = run_pdtopo(["launch", *overrides, *bad,
                      "launcher.health_timeout_s=30", f"hydra.run.dir={run}"], timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"model error in {key}" in res.stderr and "num_kv_heads" in res.stderr
    assert not (run / "supervisord.pid").exists()
    res, run = _render(tmp_path / "r", *overrides, *bad)
    assert res.returncode == 0 and f"WARNING: {key}=4" in res.stderr, res.stderr


def test_render_warns_when_the_checkpoint_is_not_on_this_machine(tmp_path):
    res, run = _render(tmp_path, "model=hf_local", "model.path=/models/elsewhere")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "does not exist on this machine" in res.stderr
    assert (run / "supervisord.conf").exists()
