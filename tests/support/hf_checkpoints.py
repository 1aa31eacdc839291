"""Tiny checkpoints written by HF transformers itself, and HF's own greedy tokens and logits.

`CASES` covers what pdtopo claims to load: Llama (default, linear and llama3 RoPE, attention
biases), Qwen2 and Qwen3; tied and untied embeddings; GQA ratios whose head counts are not
powers of two; the current config format (`rope_parameters`, transformers 5) and the older one
(top-level `rope_theta` / `rope_scaling`, rewritten from the same checkpoint). Weights are drawn
from a seeded torch generator with std 1/sqrt(fan_in) (transformers' 0.02 init would make all
logits nearly tie). `hf_greedy` runs HF's forward in float32 and returns its tokens, the logits
at the last prompt position and the smallest top-1 margin over the generated positions.

`save_chat_tokenizer` puts a tokenizer saved by transformers itself beside a checkpoint: a
byte-level BPE of exactly VOCAB ids trained with `tokenizers`, BOS added by its post-processor,
wrapped in `PreTrainedTokenizerFast` with a chat template (by default SmolLM2-Instruct's, which
adds a system prompt when the chat has none), so `save_pretrained` writes `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja` and `additional_chat_templates/` as transformers
5 does for a real instruct model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 320  # >= the tokenizer trained by tests.e2e.test_loader (for servers that load one)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@dataclass(frozen=True)
class Case:
    name: str
    arch: str                       # llama | qwen2 | qwen3
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    tied: bool = False
    old_format: bool = False        # rewrite config.json the transformers-4 way
    rope: dict[str, Any] | None = None  # scaling parameters (rope_type + its fields)
    extra: dict[str, Any] = field(default_factory=dict)
    theta: float = 1000.0
    layers: int = 2
    intermediate: int = 64


CASES = [
    Case("llama_gqa3", "llama", heads=6, kv_heads=2, head_dim=8, hidden=48),
    Case("llama_llama3_rope", "llama", heads=6, kv_heads=3, head_dim=8, hidden=48, rope=LLAMA3),
    Case("llama_llama3_rope_old_tied", "llama", heads=4, kv_heads=4, head_dim=12, hidden=48,
         tied=True, old_format=True, rope=LLAMA3),
    Case("llama_linear_rope_old", "llama", heads=6, kv_heads=2, head_dim=8, hidden=48,
         old_format=True, rope={"rope_type": "linear", "factor": 4.0}),
    Case("llama_attention_bias", "llama", heads=6, kv_heads=2, head_dim=8, hidden=48,
         extra={"attention_bias": True}),
    Case("qwen2_mqa_tied", "qwen2", heads=7, kv_heads=1, head_dim=8, hidden=56, tied=True),
    Case("qwen2_gqa3_old", "qwen2", heads=6, kv_heads=2, head_dim=8, hidden=48,
         old_format=True),
    Case("qwen3_head_dim", "qwen3", heads=6, kv_heads=3, head_dim=16, hidden=48),
    Case("qwen3_old_tied", "qwen3", heads=10, kv_heads=5, head_dim=8, hidden=40, tied=True,
         old_format=True),
]
CASE_IDS = [c.name for c in CASES]


def _hf_classes(arch: str):
    import transformers as tf

    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]


def _randomize(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _old_format(config: dict[str, Any]) -> dict[str, Any]:
    """The transformers-4 layout of the same config: top-level rope_theta / rope_scaling."""
    out = dict(config)
    rope = dict(out.pop("rope_parameters"))
    out["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    out.pop("layer_types", None)
    return out


def build(case: Case, root: Path, seed: int = 0):
    """Write `case` as an HF checkpoint under root/case.name; returns (directory, HF model)."""
    config_cls, model_cls = _hf_classes(case.arch)
    rope = {"rope_theta": case.theta, "rope_type": "default", **(case.rope or {})}
    kwargs = dict(vocab_size=VOCAB, hidden_size=case.hidden, intermediate_size=case.intermediate,
                  num_hidden_layers=case.layers, num_attention_heads=case.heads,
                  num_key_value_heads=case.kv_heads, head_dim=case.head_dim,
                  max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=case.tied, rope_parameters=rope,
                  bos_token_id=None, eos_token_id=1, **case.extra)
    model = model_cls(config_cls(**kwargs)).float().eval()
    _randomize(model, seed)
    if case.tied:
        model.tie_weights()
    directory = root / case.name
    model.save_pretrained(str(directory))
    cfg_file = directory / "config.json"
    written = json.loads(cfg_file.read_text())
    assert "rope_parameters" in written and "rope_theta" not in written, written
    if case.old_format:
        cfg_file.write_text(json.dumps(_old_format(written), indent=2))
    return directory, model


@dataclass
class HFReference:
    tokens: list[int]               # greedy continuation
    last_logits: np.ndarray         # logits at the last prompt position [vocab]
    min_margin: float               # smallest top1 - top2 over every generated position
    step_logits: np.ndarray         # logits that chose each generated token [n, vocab]


def hf_greedy(model, prompt: list[int], n: int) -> HFReference:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
        all_logits = model(torch.tensor([ids[:-1]])).logits[0].double().numpy()
    chosen = all_logits[len(prompt) - 1:]
    top2 = np.sort(chosen, axis=-1)[:, -2:]
    return HFReference(tokens=ids[len(prompt):], last_logits=chosen[0],
                       min_margin=float((top2[:, 1] - top2[:, 0]).min()), step_logits=chosen)


def hf_greedy_cached(model, prompt: list[int], n: int) -> HFReference:
    """`hf_greedy` for a real-sized model: a greedy loop over HF's KV cache (EOS does not stop
    it), then one forward over the whole sequence for the logits and margins, which must pick
    the same tokens."""
    import inspect

    import torch

    # transformers renames `past_key_values` to `cache` (the old name warns from 5.2x)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tokens.append(int(torch.argmax(out.logits[0, -1])))
            out = model(torch.tensor([[tokens[-1]]]), use_cache=True,
                        **{name: out[name]})
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0].double().numpy()
    chosen = logits[len(prompt) - 1:]
    assert [int(t) for t in chosen.argmax(-1)] == tokens  # the cache changed no choice
    top2 = np.sort(chosen, axis=-1)[:, -2:]
    return HFReference(tokens=tokens, last_logits=chosen[0],
                       min_margin=float((top2[:, 1] - top2[:, 0]).min()), step_logits=chosen)


def prompts(seed: int, lengths: tuple[int, ...] = (5, 23, 41)) -> list[list[int]]:
    """Seeded prompts over the whole vocabulary (lengths across several 8-token pages)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(2, VOCAB, size=n)] for n in lengths]


# SmolLM2-135M-Instruct's chat template: ChatML plus a default system prompt
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "What is the capital of France? The capital of France is Paris.",
    "the quick brown fox jumps over the lazy dog; hello world, how are you today?",
    "system user assistant: Tell me a story about a cat who likes numbers 0123456789.",
] * 8


def train_byte_bpe(corpus: list[str], specials: list[str], vocab: int = VOCAB):
    """A byte-level BPE of exactly `vocab` ids trained on `corpus`, `specials` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, show_progress=False, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    return tok


def save_chat_tokenizer(directory: Path, template: str | dict[str, str] = SMOL_TEMPLATE):
    """Write a transformers-saved tokenizer into `directory`; returns the HF tokenizer."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_bpe(CHAT_CORPUS, CHAT_SPECIALS)
    # BOS from the post-processor: a chat must not get it unless its template writes it
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                 eos_token="<|im_end|>", pad_token="<|im_end|>")
    hf.chat_template = template
    hf.save_pretrained(str(directory))
    assert (directory / "chat_template.jinja").is_file()
    return hf


def hf_chat_ids(hf_tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                **kwargs: Any) -> list[int]:
    """transformers' own prompt ids for a chat (`apply_chat_template(tokenize=True)`)."""
    return list(hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **kwargs))


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    """HF `generate`'s greedy tokens, EOS not stopping it (as pdtopo's `ignore_eos`)."""
    import copy

    import torch

    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=None, max_new_tokens=n, min_new_tokens=None, do_sample=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return [int(t) for t in out[0, len(prompt):]]
