"""Chat templates: where a checkpoint keeps them and how they render (like transformers).

Found as transformers finds them: `chat_template.jinja` (the default template)
and `additional_chat_templates/<name>.jinja` (named ones) beside tokenizer.json; when any of
these files exists they replace `tokenizer_config.json`'s `chat_template` field (a string, or a
list of `{name, template}`). The "default" template is the one used (transformers' rule for a
model with several); templates but no default make chat requests fail naming the files; a
template that does not compile is refused at load, naming the file. A model
without any template uses pdtopo's documented fallback `DEFAULT_CHAT_TEMPLATE`
(`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`), logged once at load.

`render_chat(template, messages, ...)` renders in an environment like transformers': a
jinja2 `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`, the `loopcontrols`
extension and `{% generation %}` blocks; `tojson` (no HTML escaping, `indent`, `separators`,
`sort_keys`), `raise_exception`, `strftime_now`, and `dict` / `namespace` that refuse
underscore names. The template sees `messages` (a null content as "", other None keys
dropped; text parts of a content list joined), `tools`, `documents`, `add_generation_prompt`
and the special-token strings of tokenizer_config.json.
A model's template writes its special tokens itself, so its rendered text is tokenized with
`add_special_tokens=False` (as `transformers`' `apply_chat_template(tokenize=True)` does);
only the fallback template's text gets the tokenizer's own special tokens (BOS):
`Tokenizer.chat_add_special_tokens` says which.

    find_chat_templates(dir, tokenizer_config) -> {name: template}, source   (load time)
    compile_template(template)                 -> a cached jinja2 Template   (load time: checks)
    render_chat(template, messages, **context) -> the prompt text           (per chat request)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def check_messages(messages: Any) -> list[dict]:
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
def compile_template(template: str):
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


def render_chat(template: str, messages: list[dict], **kwargs: Any) -> str:
    compiled = compile_template(template)
    try:
        return compiled.render(messages=messages, **kwargs)
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


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
