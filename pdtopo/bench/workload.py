"""Benchmark workloads: the requests a run sends, built before the clock starts.

`synthetic(settings)` draws prompt/output lengths (uniform around `input_len`/`output_len`,
seeded) and random prompt token ids; `load_jsonl(path, settings)` reads a dataset with one
request per line: `{"prompt": str}` or `{"input_ids": [int]}`, and optional `"output_len"`.
`build_workload(settings)` picks one of the two. Every request carries its expected output
length so the statistics can count tokens exactly.

`multiturn(settings)` builds conversations instead (`bench.workload: multiturn`): each starts
from one of `system_prompts` shared system prompts and has `turns` user messages; the load
generator sends turn t+1 after turn t's answer, its prompt being the conversation so far (so a
prefix cache can serve everything but the newest message).

`chat_conversations(settings)` reads real text (`bench.workload: chat`): a JSONL of
conversations, `{"system": str (optional), "turns": [str, ...]}` per line (`bench.dataset`, by
default `CHAT_DATASET`, shipped with pdtopo), cycled to `multiturn.conversations` conversations
of `multiturn.turns` turns; the load generator sends them to `/v1/chat/completions`, so the
server's own tokenizer and chat template make the prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from pdtopo.bench.settings import BenchSettings
from pdtopo.config.schema import TopologyError

CHAT_DATASET = Path(__file__).parent / "data" / "chat_conversations.jsonl"


@dataclass
class BenchRequest:
    output_len: int
    prompt: str | None = None
    input_ids: list[int] | None = None
    tag: str = ""                 # optional class label (e.g. "long" in a mixed workload)

    @property
    def input_len(self) -> int | None:
        return len(self.input_ids) if self.input_ids is not None else None

    def body(self, settings: BenchSettings) -> dict:
        sampling = {"max_new_tokens": self.output_len, "temperature": settings.temperature,
                    "ignore_eos": settings.ignore_eos}
        body: dict = {"sampling_params": sampling, "stream": True}
        if self.input_ids is not None:
            body["input_ids"] = self.input_ids
        else:
            body["text"] = self.prompt
        return body


@dataclass
class Conversation:
    system_ids: list[int]
    user_ids: list[list[int]]       # one new user message per turn
    output_lens: list[int]          # answer length per turn
    index: int = 0

    def prompt(self, history: list[int], turn: int) -> list[int]:
        """The prompt of `turn`: the conversation so far (`history`: the previous turn's
        prompt and answer; empty for the first turn) plus this turn's user message."""
        return (history or list(self.system_ids)) + self.user_ids[turn]


@dataclass
class ChatConversation:
    turns: list[str]                # user messages, one per turn
    output_lens: list[int]          # answer length per turn
    system: str | None = None
    index: int = 0


def _json_lines(path: Path) -> list[tuple[str, dict]]:
    """(where, object) of every non-empty line; bad JSON is a `bench.dataset` error."""
    if not path.is_file():
        raise TopologyError("bench.dataset", str(path), "no such file")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TopologyError("bench.dataset", where, f"invalid JSON: {exc}") from None
        if not isinstance(item, dict):
            raise TopologyError("bench.dataset", where, "each line must be a JSON object")
        out.append((where, item))
    return out


def chat_conversations(settings: BenchSettings) -> list[ChatConversation]:
    path = Path(settings.dataset or CHAT_DATASET).expanduser()
    mt = settings.multiturn
    read = []
    for where, item in _json_lines(path):
        turns, system = item.get("turns"), item.get("system")
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t
                                                           for t in turns)):
            raise TopologyError("bench.dataset", where, "'turns' must be a non-empty list of "
                                                        "non-empty strings (user messages)")
        if len(turns) < mt.turns:
            raise TopologyError("bench.multiturn.turns", mt.turns,
                                f"{where} has {len(turns)} turns only")
        if system is not None and not isinstance(system, str):
            raise TopologyError("bench.dataset", where, "'system' must be a string")
        read.append((system, turns[:mt.turns]))
    if not read:
        raise TopologyError("bench.dataset", str(path), "holds no conversations")
    rng = random.Random(settings.seed * 1_000_003 + 4099)
    out = []
    for c in range(mt.conversations):
        system, turns = read[c % len(read)]
        outs = _lengths(rng, mt.turns, settings.output_len, settings.output_len_range)
        out.append(ChatConversation(turns=list(turns), output_lens=outs, system=system, index=c))
    return out


def multiturn(settings: BenchSettings) -> list[Conversation]:
    mt = settings.multiturn
    rng = random.Random(settings.seed * 1_000_003 + 31337)
    lo, hi = settings.token_id_range
    systems = [[rng.randrange(lo, hi) for _ in range(mt.system_len)]
               for _ in range(mt.system_prompts)]
    out = []
    for c in range(mt.conversations):
        outs = _lengths(rng, mt.turns, settings.output_len, settings.output_len_range)
        users = [[rng.randrange(lo, hi) for _ in range(mt.user_len)] for _ in range(mt.turns)]
        out.append(Conversation(system_ids=systems[c % len(systems)], user_ids=users,
                                output_lens=outs, index=c))
    return out


def _lengths(rng: random.Random, n: int, mean: int, spread: float) -> list[int]:
    lo = max(1, round(mean * (1 - spread)))
    hi = max(lo, round(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


def synthetic(settings: BenchSettings, n: int | None = None, *, seed_offset: int = 0,
              input_len: int | None = None, output_len: int | None = None,
              tag: str = "") -> list[BenchRequest]:
    n = settings.num_requests if n is None else n
    rng = random.Random(settings.seed * 1_000_003 + seed_offset)
    ins = _lengths(rng, n, input_len or settings.input_len, settings.input_len_range)
    outs = _lengths(rng, n, output_len or settings.output_len, settings.output_len_range)
    lo, hi = settings.token_id_range
    return [BenchRequest(output_len=o, input_ids=[rng.randrange(lo, hi) for _ in range(i)],
                         tag=tag) for i, o in zip(ins, outs, strict=True)]


def load_jsonl(path: str | Path, settings: BenchSettings) -> list[BenchRequest]:
    path = Path(path).expanduser()
    out: list[BenchRequest] = []
    for where, item in _json_lines(path):
        olen = item.get("output_len", settings.output_len)
        if isinstance(olen, bool) or not isinstance(olen, int) or olen < 1:
            raise TopologyError("bench.dataset", where, f"output_len={olen!r}: expected int >= 1")
        ids, prompt = item.get("input_ids"), item.get("prompt")
        if ids is not None:
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
                raise TopologyError("bench.dataset", where,
                                    "input_ids must be a non-empty int list")
            out.append(BenchRequest(olen, input_ids=ids, tag=str(item.get("tag", ""))))
        elif isinstance(prompt, str) and prompt:
            out.append(BenchRequest(olen, prompt=prompt, tag=str(item.get("tag", ""))))
        else:
            raise TopologyError("bench.dataset", where, "needs a non-empty 'prompt' or 'input_ids'")
    if not out:
        raise TopologyError("bench.dataset", str(path), "holds no requests")
    return out


def build_workload(settings: BenchSettings) -> list[BenchRequest]:
    if settings.dataset:
        reqs = load_jsonl(settings.dataset, settings)
        return [reqs[i % len(reqs)] for i in range(settings.num_requests)]
    return synthetic(settings)


def warmup_workload(settings: BenchSettings) -> list[BenchRequest]:
    return synthetic(settings, settings.warmup_requests, seed_offset=7919,
                     output_len=min(settings.output_len, 4)) if settings.warmup_requests else []
