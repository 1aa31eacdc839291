"""Chat templates as transformers saves and renders them: tokenizers written by transformers
itself (`tests.support.hf_checkpoints.save_chat_tokenizer`: `chat_template.jinja`,
`additional_chat_templates/`), pdtopo's prompt ids compared with
`PreTrainedTokenizerFast.apply_chat_template(tokenize=True)` for several conversations, the
template environment's extras compared with transformers' rendering, which file wins, and the
documented fallback for a model without a template (logged once)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pdtopo.runtime.model.tokenizer import HFTokenizer, load_tokenizer
from tests.support.hf_checkpoints import (
    CASES,
    SMOL_TEMPLATE,
    build,
    hf_chat_ids,
    save_chat_tokenizer,
)

SYSTEM = {"role": "system", "content": "Answer in one word."}
Q1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
Q2 = {"role": "user", "content": "And of Japan? 東京 is a guess — café"}
CHATS = {"user": [Q1], "system_user": [SYSTEM, Q1], "multi_turn": [Q1, A1, Q2],
         "system_multi_turn": [SYSTEM, Q1, A1, Q2]}


def _pdtopo_ids(tok: HFTokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """What /v1/chat/completions does with a chat: render, then encode as the template says."""
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tok.encode(text, add_special_tokens=tok.chat_add_special_tokens)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, object]:
    directory = tmp_path_factory.mktemp("chat") / "tok"
    return directory, save_chat_tokenizer(directory)


@pytest.mark.parametrize("gen", [True, False], ids=["gen_prompt", "no_gen_prompt"])
@pytest.mark.parametrize("chat", list(CHATS), ids=list(CHATS))
def test_prompt_ids_equal_transformers(saved, chat, gen):
    directory, hf = saved
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert "chat_template" not in config  # transformers 5 writes chat_template.jinja instead
    tok = HFTokenizer(directory)
    assert tok.chat_template == SMOL_TEMPLATE and not tok.chat_add_special_tokens
    ids = _pdtopo_ids(tok, CHATS[chat], gen)
    assert ids == hf_chat_ids(hf, CHATS[chat], add_generation_prompt=gen)
    # the model's default system prompt exactly when the chat has none; no BOS added by encode
    has_system = CHATS[chat][0]["role"] == "system"
    assert ("named SmolLM" in tok.apply_chat_template(CHATS[chat])) != has_system
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>")


def test_template_file_wins_over_tokenizer_config(tmp_path, saved):
    """As in transformers: chat_template.jinja replaces tokenizer_config.json's field; without
    the file the field is used."""
    from transformers import AutoTokenizer

    directory, hf = saved
    target = tmp_path / "tok"
    target.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (target / f).write_bytes((directory / f).read_bytes())
    config = json.loads((target / "tokenizer_config.json").read_text())
    legacy = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": legacy}))
    assert AutoTokenizer.from_pretrained(str(target)).chat_template == SMOL_TEMPLATE
    assert HFTokenizer(target).chat_template == SMOL_TEMPLATE
    (target / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(str(target)).chat_template == legacy
    tok = HFTokenizer(target)
    assert tok.apply_chat_template([Q1]) == "[user] What is the capital of France?\n"


def test_additional_templates_use_the_default(tmp_path):
    tool_use = "{{ 'TOOLS ' + messages[0]['content'] }}"
    hf = save_chat_tokenizer(tmp_path / "tok", {"default": SMOL_TEMPLATE, "tool_use": tool_use})
    assert (tmp_path / "tok" / "additional_chat_templates" / "tool_use.jinja").is_file()
    tok = HFTokenizer(tmp_path / "tok")
    assert tok.chat_templates == {"default": SMOL_TEMPLATE, "tool_use": tool_use}
    assert _pdtopo_ids(tok, [SYSTEM, Q1], True) == hf_chat_ids(hf, [SYSTEM, Q1])
    # named templates without a default: transformers refuses, so does pdtopo (naming the file)
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        hf_chat_ids(hf.__class__.from_pretrained(str(tmp_path / "tok")), [Q1])
    with pytest.raises(ValueError, match=r"no default one \(chat_template.jinja\)"):
        HFTokenizer(tmp_path / "tok").apply_chat_template([Q1])


# what transformers' template environment offers beyond plain jinja2
FEATURES = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' %}{% continue %}{% endif -%}"
    "{%- if loop.index > 3 %}{% break %}{% endif -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "{% generation %}<{{ m['role'] }}>{{ m['content'] }}{% endgeneration %}\n"
    "{%- endfor -%}"
    "{{ ns.n }} {{ dict(b=2, a=1) | tojson(sort_keys=True, separators=(',', ':')) }} "
    "{{ {'k': '<é>'} | tojson(indent=1) }} {{ strftime_now('%Y') }} {{ bos_token }}"
    "{{ eos_token }}{{ pad_token }}{% if tools is none %} no-tools{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_environment_matches_transformers(tmp_path, saved):
    directory, hf = saved
    target = tmp_path / "tok"
    target.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (target / f).write_bytes((directory / f).read_bytes())
    (target / "chat_template.jinja").write_text(FEATURES)
    tok = HFTokenizer(target)
    chat = [SYSTEM, Q1, A1, Q2, A1]
    for gen in (True, False):
        ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(chat, chat_template=FEATURES, tokenize=False,
                                              add_generation_prompt=gen)
        assert _pdtopo_ids(tok, chat, gen) == hf_chat_ids(hf, chat, gen, chat_template=FEATURES)
    (target / "chat_template.jinja").write_text(
        "{{ raise_exception('only user turns, got ' + messages[0]['role']) }}")
    with pytest.raises(ValueError, match="only user turns, got system"):
        HFTokenizer(target).apply_chat_template([SYSTEM])
    (target / "chat_template.jinja").write_text(
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}")
    with pytest.raises(ValueError, match="__class__"):
        HFTokenizer(target).apply_chat_template([Q1])
    (target / "chat_template.jinja").write_text("{% for m in messages %}{{ m }")
    with pytest.raises(ValueError, match=r"chat template 'default' .*chat_template.jinja.*"
                                         r"does not compile"):
        HFTokenizer(target)  # refused at load, not at the first chat request


def test_no_template_uses_the_fallback_and_logs_once(tmp_path, caplog):
    directory, _ = build(CASES[0], tmp_path)
    hf = save_chat_tokenizer(directory)
    (directory / "chat_template.jinja").unlink()
    caplog.set_level(logging.INFO, logger="pdtopo.tokenizer")
    tok = load_tokenizer({"path": str(directory), "tokenizer": "hf"})
    for _ in range(3):
        text = tok.apply_chat_template([SYSTEM, Q1])
    assert text == "<|system|>\nAnswer in one word.\n<|user|>\nWhat is the capital of France?" \
                   "\n<|assistant|>\n"
    assert tok.chat_template is None and tok.chat_add_special_tokens  # the BOS is added
    expected = hf("<|user|>\nWhat is the capital of France?\n<|assistant|>\n")["input_ids"]
    assert expected[0] == hf.bos_token_id and _pdtopo_ids(tok, [Q1], True) == expected
    said = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(said) == 1 and str(directory) in said[0] and "chat_template.jinja" in said[0]
