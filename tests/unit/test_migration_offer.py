"""Migration's pure parts (issue 50): the offer D1 sends D2 is validated like a side-channel
message, and the relay around the client's sink passes every token once and nothing after the
end, whichever D emits it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdtopo.runtime.disagg.migration import RelaySink
from pdtopo.runtime.disagg.transport.messages import MessageError, MigrationOffer
from pdtopo.runtime.engine.request import ReqOutput, TokenLogprob

GOOD = MigrationOffer(room=5, rid="r", source="127.0.0.1:5000", prompt_ids=(1, 2, 3),
                      output_ids=(4, 5), num_computed=4, page_count=1,
                      sampling={"temperature": 0.5, "seed": 3, "stop": ["x"]})


def _wire(offer: MigrationOffer) -> dict:
    return json.loads(json.dumps(offer.to_dict()))


def test_offer_round_trips_through_json():
    assert MigrationOffer.from_dict(_wire(GOOD)) == GOOD
    lp = replace(GOOD, output_logprobs=(TokenLogprob(-0.5, ((4, -0.5), (9, -1.0))), None),
                 sampling={**GOOD.sampling, "logprobs": 2})
    assert MigrationOffer.from_dict(_wire(lp)) == lp


@pytest.mark.parametrize("key,bad", [
    ("room", -1), ("room", True), ("source", "nohost"), ("source", "h:0"), ("num_computed", 5),
    ("output_ids", []), ("prompt_ids", [1, -2]), ("prompt_ids", [1, True]), ("page_count", 0),
    ("page_count", 99), ("sampling", {"seed": None}), ("sampling", {"seed": 1, "bogus": 1}),
    ("sampling", {"seed": 1, "temperature": "hot"}), ("sampling", {"seed": 1, "stop": [""]}),
    ("sampling", {}), ("output_logprobs", [None]), ("output_logprobs", [[0.1, []], "x"]),
    ("cached_tokens", 9), ("v", 2), ("type", "ready")])
def test_offer_validation_names_what_is_wrong(key, bad):
    d = _wire(GOOD)
    d[key] = bad
    with pytest.raises(MessageError, match="migrate"):
        MigrationOffer.from_dict(d)


class _Client:
    def __init__(self):
        self.outs = []

    def emit(self, out):
        self.outs.append(out)


def _out(tokens, total, finished=False, lps=None):
    return ReqOutput(rid="r", new_token_ids=list(tokens), num_output_tokens=total,
                     prompt_tokens=3, finished=finished,
                     finish_reason={"type": "length"} if finished else None, new_logprobs=lps)


def test_relay_passes_each_token_once_and_nothing_after_the_end():
    client = _Client()
    relay = RelaySink(client)
    relay.emit(_out([7], 1))
    relay.emit(_out([8, 9], 3, lps=["a", "b"]))   # D1, up to the move
    relay.emit(_out([9, 10], 4, lps=["b", "c"]))  # a side that re-sends token 2: only 3 passes
    relay.emit(_out([9], 3))                      # nothing new: dropped
    relay.emit(_out([11], 5, finished=True))
    relay.emit(_out([12], 6))                     # after the end: dropped
    relay.emit(_out([], 6, finished=True))
    assert [t for o in client.outs for t in o.new_token_ids] == [7, 8, 9, 10, 11]
    assert client.outs[2].new_logprobs == ["c"]
    assert [o.finished for o in client.outs] == [False, False, False, True]
