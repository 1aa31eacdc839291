"""KVPoll values and the monotonic KVPollState holder."""

from __future__ import annotations

import pytest

from pdtopo.runtime.disagg.transport.kvpoll import InvalidKVTransition, KVPoll, KVPollState


def test_values_match_sglang():
    assert [int(s) for s in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput,
                             KVPoll.Transferring, KVPoll.Success)] == [0, 1, 2, 3, 4]


def test_forward_path_and_noop():
    s = KVPollState()
    assert s.state == KVPoll.Bootstrapping
    s.advance(KVPoll.WaitingForInput)
    s.advance(KVPoll.WaitingForInput)  # same state: no-op
    s.advance(KVPoll.Transferring)
    s.advance(KVPoll.Success)
    assert s.state == KVPoll.Success and s.error is None


def test_skipping_forward_is_allowed():
    s = KVPollState()
    s.advance(KVPoll.Transferring)
    assert s.state == KVPoll.Transferring


@pytest.mark.parametrize("start,back", [(KVPoll.WaitingForInput, KVPoll.Bootstrapping),
                                        (KVPoll.Transferring, KVPoll.WaitingForInput)])
def test_backwards_raises(start, back):
    s = KVPollState(label="room 5")
    s.advance(start)
    with pytest.raises(InvalidKVTransition, match="room 5.*backwards"):
        s.advance(back)
    assert s.state == start


def test_terminal_states():
    ok = KVPollState()
    ok.advance(KVPoll.Success)
    with pytest.raises(InvalidKVTransition, match="terminal"):
        ok.advance(KVPoll.Transferring)
    assert ok.fail(RuntimeError("late")) is False and ok.state == KVPoll.Success

    bad = KVPollState()
    err = RuntimeError("boom")
    assert bad.fail(err) is True
    assert bad.state == KVPoll.Failed and bad.error is err
    assert bad.fail(RuntimeError("again")) is False and bad.error is err
    with pytest.raises(InvalidKVTransition, match="terminal"):
        bad.advance(KVPoll.Success)


def test_failed_only_through_fail():
    s = KVPollState()
    with pytest.raises(InvalidKVTransition, match="fail"):
        s.advance(KVPoll.Failed)
