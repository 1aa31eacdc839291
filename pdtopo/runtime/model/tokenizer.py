"""Tokenizers: the byte tokenizer of random-init models and Hugging Face `tokenizer.json`.

`load_tokenizer(model_cfg)` picks one from `model.tokenizer` (`byte` | `hf`); `hf` reads
`<model.path>/tokenizer.json` through the `tokenizers` library and `tokenizer_config.json`
(chat template, BOS/EOS strings) when present.

Byte tokenizer: ids 0-255 are the UTF-8 bytes, 256 = BOS, 257 = EOS (ids above 257 up to the
model's vocab are unused and decode to nothing).

Streaming detokenization: use `StreamDecoder(tokenizer)`; `push(new_ids)` returns the text
that became final. It decodes a short window of ids (from a prefix offset, so that word-joining
spaces come out right) and diffs it against the window's previous text; it holds back output
that ends in U+FFFD, i.e. an incomplete UTF-8 sequence (a multi-byte character split across
tokens). `flush()` returns what is still held back at the end of a request.

Chat templates: `apply_chat_template(messages)` renders tokenizer_config.json's `chat_template`
(jinja2, sandboxed, with `add_generation_prompt=True`, `bos_token`, `eos_token`); without one it
uses the documented default `DEFAULT_CHAT_TEMPLATE`: `<|role|>\\ncontent\\n` per message, then
`<|assistant|>\\n`. The rendered text may already contain the BOS string; `encode` adds special
tokens per tokenizer.json's post-processor, so call `encode(text, add_special_tokens=False)`
for rendered chat prompts whose template inserts BOS itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from omegaconf import DictConfig
from tokenizers import Tokenizer as _Tok

from pdtopo.model_config.spec import ModelConfig, model_config_from_cfg

BYTE_BOS, BYTE_EOS = 256, 257
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, Mapping) and p.get("type") == "text")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


def _render(template: str, messages: list[dict], **kwargs: Any) -> str:
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, **kwargs)
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


class Tokenizer:
    """Common interface (see module docstring)."""

    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        msgs = _check_messages(messages)
        return _render(self.chat_template or DEFAULT_CHAT_TEMPLATE, msgs,
                       add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)


class ByteTokenizer(Tokenizer):
    def __init__(self, vocab_size: int = 512, bos_token_id: int = BYTE_BOS,
                 eos_token_ids: Sequence[int] = (BYTE_EOS,)):
        if vocab_size < 258:
            raise ValueError(f"model.vocab_size={vocab_size}: the byte tokenizer needs >= 258")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids) or [BYTE_EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` from tokenizer.json plus tokenizer_config.json's extras."""

    def __init__(self, directory: str | Path, model: ModelConfig | None = None):
        directory = Path(directory)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in model.path={str(directory)!r}")
        self._tok = _Tok.from_file(str(tok_file))
        conf_file = directory / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
        self.chat_template = self._pick_template(conf.get("chat_template"))
        self.bos_token = self._token_str(conf.get("bos_token"))
        self.eos_token = self._token_str(conf.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = list(model.eos_token_ids) if model and model.eos_token_ids else []
        if not eos and self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos = [self._tok.token_to_id(self.eos_token)]
        self.eos_token_ids = eos
        bos = model.bos_token_id if model else None
        if bos is None and self.bos_token:
            bos = self._tok.token_to_id(self.bos_token)
        self.bos_token_id = bos
        if not self.bos_token and bos is not None:
            self.bos_token = self._tok.id_to_token(bos) or ""
        if not self.eos_token and eos:
            self.eos_token = self._tok.id_to_token(eos[0]) or ""

    @staticmethod
    def _token_str(value: Any) -> str:
        if isinstance(value, Mapping):
            return str(value.get("content", ""))
        return value or ""

    @staticmethod
    def _pick_template(value: Any) -> str | None:
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
            return named.get("default") or next(iter(named.values()), None)
        return value

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class StreamDecoder:
    """Incremental detokenization of one request's output ids (see module docstring)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully emitted
        self._read = 0    # ids up to here have been emitted

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):]


def load_tokenizer(model_cfg: DictConfig | Mapping[str, Any] | ModelConfig) -> Tokenizer:
    cfg = model_cfg if isinstance(model_cfg, ModelConfig) else model_config_from_cfg(model_cfg)
    if cfg.tokenizer == "byte":
        return ByteTokenizer(cfg.vocab_size, cfg.bos_token_id if cfg.bos_token_id is not None
                             else BYTE_BOS, cfg.eos_token_ids or (BYTE_EOS,))
    if not cfg.path:
        raise ValueError("model.tokenizer=hf needs model.path (a directory with tokenizer.json)")
    return HFTokenizer(cfg.path, cfg)
