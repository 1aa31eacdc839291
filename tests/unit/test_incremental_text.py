"""The streamed text decodes only the newest ids (issue 48): `IncrementalText.decode(ids)` equals
the tokenizer's whole decode of `ids` at every step, for the byte tokenizer (split UTF-8
characters, invalid bytes), byte-level BPE and a SentencePiece-style (Metaspace) tokenizer
whose decode drops the first token's leading space; and TextView's streamed chunks end in its
final text."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdtopo.runtime.api.streaming import IncrementalText, TextView
from pdtopo.runtime.engine.request import FinishReason, ReqOutput, SamplingParams
from pdtopo.runtime.model.tokenizer import ByteTokenizer, HFTokenizer


class _Wrapped(HFTokenizer):
    """An HFTokenizer around an in-memory `tokenizers.Tokenizer` (no files)."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)


def _byte_level_bpe() -> HFTokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a, b in [("h", "e"), ("he", "l"), ("l", "o"), ("\u0120", "w"), ("\u00c3", "\u00a9")]:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    return _Wrapped(tok)


def _metaspace() -> HFTokenizer:
    words = ["\u2581the", "\u2581cat", "\u2581sat", "s", "at", "\u2581", "a", "b", ".",
             "\u2581on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    return _Wrapped(tok)


TOKENIZERS = {"byte": lambda: ByteTokenizer(512), "byte_level_bpe": _byte_level_bpe,
              "metaspace": _metaspace}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_equals_the_whole_decode_at_every_step(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    for trial in range(40):
        ids = [rng.randrange(tok.vocab_size if name != "byte" else 256) for _ in range(60)]
        inc = IncrementalText(tok)
        k = 0
        while k < len(ids):
            k += rng.choice([1, 1, 1, 2, 3])  # a stream's outputs carry one or more tokens
            assert inc.decode(ids[:k]) == tok.decode(ids[:k]), (trial, k)
        assert inc.decode(ids) == tok.decode(ids)  # asked again: the kept text


def test_ids_that_do_not_extend_the_kept_ones_are_decoded_whole():
    tok = ByteTokenizer(512)
    inc = IncrementalText(tok)
    assert inc.decode(list(b"hello")) == "hello"
    assert inc.decode(list(b"help")) == "help"
    assert inc.decode(list(b"he")) == "he"


def test_streamed_chunks_end_in_the_final_text():
    tok = ByteTokenizer(512)
    sampling = SamplingParams(stop=["wör"])
    view = TextView(tok, SimpleNamespace(req=SimpleNamespace(sampling=sampling)))
    ids = list("héllo wör".encode())  # the stop string ends in the last token
    chunks = [view.delta(ids[:k], None) for k in range(1, len(ids))]
    final = ReqOutput("r", [], len(ids), 1, True, FinishReason.stop_str("wör"))
    chunks.append(view.delta(ids, final))
    assert "".join(chunks) == "héllo "
    assert "\ufffd" not in "".join(chunks)
