"""A GGUF file's tokenizer as tokenizer.json and tokenizer_config.json, built with `tokenizers`.

Supported: byte-level BPE vocabularies (`tokenizer.ggml.model` = gpt2, as Llama-3, Qwen and
SmolLM files carry). The BPE model takes the file's tokens (spelled in the byte alphabet; a
token that is not, such as a control token written in plain text, is re-spelled from its UTF-8
bytes) and merges; how text is split before the merges follows `tokenizer.ggml.pre` as llama.cpp
reads it (`PRE_TOKENIZERS`: a split regex, and for SmolLM digits one by one; Llama 3's takes a
pre-token found whole in the vocabulary without merging); tokens the file marks as control
become special tokens and user-defined ones plain added tokens, both matched whole as written,
at their own ids (a vocabulary that does not come out at exactly the file's size is refused); BOS/EOS are added
when `tokenizer.ggml.add_bos_token` / `add_eos_token` say so. tokenizer_config.json carries the
chat template (`tokenizer.chat_template`) and the special tokens' strings.

    gguf_tokenizer(file)         -> tokenizers.Tokenizer
    gguf_tokenizer_config(file)  -> the dict of tokenizer_config.json
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.sources.gguf_reading import GgufFile

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2_bytes() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    _gpt2_bytes()])


# tokenizer.ggml.pre -> the pre-tokenizer (None or missing: GPT-2's split)
PRE_TOKENIZERS = {
    "default": _gpt2_bytes,
    "gpt-2": _gpt2_bytes,
    "smollm": _digits_then_gpt2,
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


# pre-tokenizers whose models take a whole pre-token that is in the vocabulary without merging
# (Llama 3's tokenizer.json sets ignore_merges)
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _spelled(token: str) -> str:
    alphabet = _byte_alphabet()
    if set(token) <= set(alphabet.values()):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _check(file: GgufFile) -> tuple[list[str], list[int]]:
    meta, where = file.metadata, str(file.path)
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(where, "tokenizer.ggml.model", model,
                              "only byte-level BPE tokenizers (gpt2) are supported")
    pre = meta.get("tokenizer.ggml.pre")
    if pre is not None and pre not in PRE_TOKENIZERS:
        raise CheckpointError(where, "tokenizer.ggml.pre", pre,
                              f"an unknown pre-tokenizer (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens or not meta.get("tokenizer.ggml.merges"):
        raise CheckpointError(where, "tokenizer.ggml.tokens", len(tokens),
                              "the file has no vocabulary and merges")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(where, "tokenizer.ggml.token_type", len(types),
                              f"one type per token expected ({len(tokens)} tokens)")
    return tokens, types


def _token(file: GgufFile, key: str, tokens: list[str]) -> str | None:
    index = file.metadata.get(f"tokenizer.ggml.{key}")
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def gguf_tokenizer(file: GgufFile) -> Tokenizer:
    tokens, types = _check(file)
    meta = file.metadata
    pre = meta.get("tokenizer.ggml.pre") or "default"
    # control and user-defined tokens are matched whole in the text, as written; the others
    # are byte-level BPE pieces, spelled in the byte alphabet
    whole = {i for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)}
    vocab = {(t if i in whole else _spelled(t)): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                               ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in sorted(whole) if types[i] == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in sorted(whole) if types[i] == USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CheckpointError(str(file.path), "tokenizer.ggml.tokens", len(tokens),
                              f"the tokens do not form one vocabulary (built "
                              f"{tok.get_vocab_size(with_added_tokens=True)} ids: duplicates)")
    bos, eos = _token(file, "bos_token_id", tokens), _token(file, "eos_token_id", tokens)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        first, last = ([f"{bos}:0"] if add_bos else []), ([f"{eos}:0"] if add_eos else [])
        specials = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*first, "$A:0", *last]),
            pair=" ".join([*first, "$A:0", *last, *first, "$B:1", *last]),
            special_tokens=list(dict.fromkeys(specials)))
    return tok


def gguf_tokenizer_config(file: GgufFile) -> dict[str, Any]:
    tokens, _ = _check(file)
    meta = file.metadata
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        value = _token(file, key, tokens)
        if value is not None:
            config[name] = value
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
