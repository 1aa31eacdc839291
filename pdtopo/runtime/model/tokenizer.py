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

Chat templates, found as transformers finds them: `chat_template.jinja` (the default template)
and `additional_chat_templates/<name>.jinja` (named ones) beside tokenizer.json; when any of
these files exists they replace `tokenizer_config.json`'s `chat_template` field (a string, or a
list of `{name, template}`). The "default" template is the one used (transformers' rule for a
model with several); templates but no default make chat requests fail naming the files; a
template that does not compile is refused at load, naming the file. A model
without any template uses pdtopo's documented fallback `DEFAULT_CHAT_TEMPLATE`
(`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`), logged once at load.

`apply_chat_template(messages)` renders with an environment like transformers' own: a jinja2
`ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`, the `loopcontrols`
extension and `{% generation %}` blocks; `tojson` (no HTML escaping, `indent`, `separators`,
`sort_keys`), `raise_exception`, `strftime_now`, and `dict` / `namespace` that refuse
underscore names. The template sees `messages` (a null content as "", other None keys
dropped; text parts of a content list joined), `tools`, `documents`, `add_generation_prompt`
and the special-token strings of tokenizer_config.json.
A model's template writes its special tokens itself, so its rendered text is tokenized with
`add_special_tokens=False` (as `transformers`' `apply_chat_template(tokenize=True)` does);
only the fallback template's text gets the tokenizer's own special tokens (BOS):
`chat_add_special_tokens` says which.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from omegaconf import DictConfig
from tokenizers import Tokenizer as _Tok

from pdtopo.model_config.spec import ModelConfig, model_config_from_cfg

log = logging.getLogger("pdtopo.tokenizer")

BYTE_BOS, BYTE_EOS = 256, 257
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")
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
        if content is None:  # OpenAI's null content (templates concatenate it as a string)
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        # other keys whose value is None are dropped, as transformers does
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": content})
    return out


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateNamespace(Namespace):
    """jinja's `namespace()` without underscore attributes (no reach into object internals)."""

    def __init__(*args: Any, **kwargs: Any):
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not set namespace attribute {name!r}")


class _TemplateDict:
    """`dict(...)` / `dict.fromkeys(...)` for templates, without access to the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    """A chat template compiled in an environment like transformers' (module docstring)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from e


def _render(template: str, messages: list[dict], **kwargs: Any) -> str:
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, **kwargs)
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


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
        msgs = _check_messages(messages)
        if self.chat_template is None and self.chat_templates:
            raise ValueError(f"the model's chat templates ({self.chat_template_source}: "
                             f"{sorted(self.chat_templates)}) have no default one "
                             f"({CHAT_TEMPLATE_FILE})")
        specials = {**self.special_tokens, "bos_token": self.bos_token,
                    "eos_token": self.eos_token}
        return _render(self.chat_template or DEFAULT_CHAT_TEMPLATE, msgs,
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
                _compile(template)
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


def find_chat_templates(directory: Path, conf: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """({name: template}, where they came from): the template files win over the field."""
    templates: dict[str, str] = {}
    default_file = directory / CHAT_TEMPLATE_FILE
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = directory / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates, f"{directory}/{{{CHAT_TEMPLATE_FILE},{CHAT_TEMPLATE_DIR}/}}"
    value = conf.get("chat_template")
    source = f"{directory / 'tokenizer_config.json'}: chat_template"
    if isinstance(value, str):
        return {"default": value}, source
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        return {t["name"]: t["template"] for t in value if isinstance(t, Mapping)
                and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}, source
    return {}, ""


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
