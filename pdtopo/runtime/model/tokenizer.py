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

Chat templates: chat_template.py (found beside tokenizer.json, rendered like transformers');
`Tokenizer.apply_chat_template(messages)` renders the model's default one or the fallback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from tokenizers import Tokenizer as _Tok

from pdtopo.model_config.spec import ModelConfig, model_config_from_cfg
from pdtopo.runtime.model.chat_template import (
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_FILE,
    DEFAULT_CHAT_TEMPLATE,
    check_messages,
    compile_template,
    find_chat_templates,
    render_chat,
)

log = logging.getLogger("pdtopo.tokenizer")

BYTE_BOS, BYTE_EOS = 256, 257
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")


class Tokenizer:
    """Common interface (see module docstring)."""

    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: str | None = None      # the model's default template; None: the fallback
    chat_templates: dict[str, str] = {}   # every template the model has, by name
    chat_template_source: str = ""        # where chat_template came from (for logs and errors)
    special_tokens: dict[str, str] = {}   # tokenizer_config.json's special-token strings
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def chat_add_special_tokens(self) -> bool:
        """Whether a rendered chat is encoded with the tokenizer's special tokens: only the
        fallback template's (a model's template writes its own, as transformers assumes)."""
        return self.chat_template is None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        msgs = check_messages(messages)
        if self.chat_template is None and self.chat_templates:
            raise ValueError(f"the model's chat templates ({self.chat_template_source}: "
                             f"{sorted(self.chat_templates)}) have no default one "
                             f"({CHAT_TEMPLATE_FILE})")
        specials = {**self.special_tokens, "bos_token": self.bos_token,
                    "eos_token": self.eos_token}
        return render_chat(self.chat_template or DEFAULT_CHAT_TEMPLATE, msgs,
                       **{"tools": None, "documents": None, **specials,
                          "add_generation_prompt": add_generation_prompt, **kwargs})


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
        self.chat_templates, self.chat_template_source = find_chat_templates(directory, conf)
        self.chat_template = self.chat_templates.get("default")
        for name, template in self.chat_templates.items():
            try:  # a broken template is refused at load, not at the first chat request
                compile_template(template)
            except ValueError as e:
                raise ValueError(f"model.path={str(directory)!r}: chat template {name!r} "
                                 f"({self.chat_template_source}): {e}") from None
        self.special_tokens = {k: self._token_str(conf[k]) for k in _SPECIAL_TOKEN_KEYS
                               if conf.get(k)}
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch form without offsets: the same ids in half the time, and its result is
        # freed (with the GIL held, stalling the server's event loop) in 0.02 s where `encode`'s
        # takes 0.4 s for a 4 MB prompt (2M tokens)
        [enc] = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(enc.ids)

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
        log.info("model.tokenizer=byte has no chat template: chat requests use pdtopo's "
                 "fallback template (<|role|>\\ncontent\\n per message)")
        return ByteTokenizer(cfg.vocab_size, cfg.bos_token_id if cfg.bos_token_id is not None
                             else BYTE_BOS, cfg.eos_token_ids or (BYTE_EOS,))
    if not cfg.path:
        raise ValueError("model.tokenizer=hf needs model.path (a directory with tokenizer.json)")
    tok = HFTokenizer(cfg.path, cfg)
    if not tok.chat_templates:
        log.warning("model.path=%s has no chat template (%s, %s/ or tokenizer_config.json's "
                    "chat_template): chat requests use pdtopo's fallback template "
                    "(<|role|>\\ncontent\\n per message, docs/models.md)", cfg.path,
                    CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR)
    elif tok.chat_template is None:
        log.warning("model.path=%s: chat templates %s but no default (%s): chat requests will "
                    "be refused", cfg.path, sorted(tok.chat_templates), CHAT_TEMPLATE_FILE)
    else:
        log.info("chat template: %s", tok.chat_template_source)
    return tok
