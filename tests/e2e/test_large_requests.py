"""A long prompt is tokenized off the server's event loop. With a real byte-level BPE
`tokenizer.json` (the one pdtopo.model_config.random_checkpoint trains), a 4 MB prompt takes
seconds to encode; while a real colocated server encodes it, another request's stream keeps
delivering tokens and /health keeps answering, each within a few hundred ms, and the long
prompt is then refused (400: more tokens than engine.max_model_len). The 413 for bodies over
server.max_body_bytes: tests/e2e/test_body_limit.py, tests/e2e/test_pd_e2e.py."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from pdtopo.model_config.random_checkpoint import write_random_checkpoint
from pdtopo.model_config.spec import model_config_from_cfg
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.support.constants import ONE_DEVICE
from tests.support.e2e import ColocatedServer

PROMPT_BYTES = 4 * 1024 * 1024  # under server.max_body_bytes (8 MiB)
MAX_GAP_S = 0.5                  # longest wait for the next token or a /health answer
WORDS = ("the quick brown fox jumps over the lazy dog pdtopo serves tiny models paged "
         "attention reads pages hello world").split()


def long_text(n_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_bytes // 4))[:n_bytes]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bpe") / "model"
    write_random_checkpoint(root, "qwen2")
    return root


def test_server_tokenizer_gives_the_libraries_ids(checkpoint):
    tok = load_tokenizer(model_config_from_cfg({"path": str(checkpoint), "tokenizer": "hf"}))
    raw = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for text in ("hello wörld, 日本語", "<|im_start|>user\nhi<|im_end|>\n", long_text(5000)):
        for special in (True, False):
            assert tok.encode(text, special) == raw.encode(text, add_special_tokens=special).ids


class Timeline:
    """Threads that stream /generate back to back and poll /health until stopped: when each
    stream chunk arrived, and when each /health poll started and how long it took."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.chunks: list[float] = []
        self.polls: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stream, daemon=True),
                        threading.Thread(target=self._health, daemon=True)]

    def _stream(self) -> None:
        body = {"text": "hello world", "stream": True,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                try:
                    with client.stream("POST", f"{self.url}/generate", json=body) as resp:
                        for line in resp.iter_lines():
                            if line.startswith("data:") and "[DONE]" not in line:
                                json.loads(line[5:])
                                self.chunks.append(time.perf_counter())
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def _health(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                status = client.get(f"{self.url}/health").status_code
                self.polls.append((t0, time.perf_counter() - t0, status))
                time.sleep(0.05)

    def __enter__(self) -> Timeline:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(self.chunks) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.chunks) >= 20, f"no stream flowing: {self.errors}"
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)  # the stream runs on past the window
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def max_chunk_gap(self, start: float, end: float) -> tuple[float, int]:
        """The longest wait between consecutive chunks over [start, end], and how many
        arrived in it."""
        times = sorted(self.chunks)
        inside = [t for t in times if start <= t <= end]
        before = [t for t in times if t < start][-1:]
        after = [t for t in times if t > end][:1]
        edge = before + inside + after
        assert before and after, "the streams did not cover the window"
        return max(b - a for a, b in zip(edge, edge[1:], strict=False)), len(inside)


@pytest.mark.slow
def test_long_prompt_does_not_stall_streams_or_health(tmp_path, checkpoint):
    text = long_text(PROMPT_BYTES)
    raw = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    t0 = time.perf_counter()
    tokens = len(raw.encode(text).ids)
    encode_s = time.perf_counter() - t0
    assert encode_s > 1.0, f"the encode takes {encode_s:.2f} s: too short to show a stall"
    overrides = ["model=hf_local", f"model.path={checkpoint}", "engine.max_model_len=256",
                 "engine.num_pages=64", "engine.page_size=8", "engine.max_prefill_tokens=64",
                 "engine.max_running_requests=4", "engine.max_new_tokens_limit=200"]
    with ColocatedServer(None, overrides, tmp_path / "server.log", env=ONE_DEVICE) as server:
        with Timeline(server.url) as timeline:
            sent = time.perf_counter()
            resp = httpx.post(f"{server.url}/generate", timeout=120,
                              json={"text": text, "sampling_params": {"max_new_tokens": 1}})
            answered = time.perf_counter()
        assert timeline.errors == []
    took = answered - sent
    # the server encoded the whole prompt (its error counts the tokens), and that took long
    assert resp.status_code == 400 and f"{tokens} tokens" in resp.text, resp.text[:300]
    assert took > 1.0, f"the long request took {took:.2f} s: no encode to see"
    gap, arrived = timeline.max_chunk_gap(sent, answered)
    assert gap < MAX_GAP_S, (f"a stream waited {gap:.2f} s for its next token while a "
                             f"{PROMPT_BYTES >> 20} MB prompt was encoded ({took:.2f} s)")
    assert arrived >= 10
    polls = [(lat, st) for t, lat, st in timeline.polls if sent <= t <= answered]
    assert len(polls) >= 3 and all(st == 200 for _, st in polls), polls
    assert max(lat for lat, _ in polls) < MAX_GAP_S, polls
    print(f"encode {encode_s:.2f} s here, request {took:.2f} s, longest stream gap "
          f"{gap * 1000:.0f} ms ({arrived} tokens meanwhile), longest /health "
          f"{max(lat for lat, _ in polls) * 1000:.0f} ms")
