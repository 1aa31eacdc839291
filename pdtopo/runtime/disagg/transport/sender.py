"""JaxTransferKVSender: P's side of one room (docs/protocol.md#abstract-roles).

The manager (manager.py) creates it at the request's arrival and feeds it D's messages:

    D's want    -> _on_want: D is known (and its prefix-cache claim and KV layout)
    send(pages) -> the manager gathers and registers the pages, `ready` goes to D
    D's done    -> _on_done: the registration is released -> Success
    D's failed, an expiry, abort() -> Failed (D is told where it does not know yet)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, same_layout
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.base import BaseKVSender, KVTransferError
from pdtopo.runtime.disagg.transport.endpoint import RoomEndpoint
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll, KVPollState
from pdtopo.runtime.disagg.transport.peer_watch import Peer


class JaxTransferKVSender(RoomEndpoint, BaseKVSender):
    """P side of one room (create with `JaxTransferKVManager.create_sender`)."""

    def __init__(self, mgr: Any, room: int) -> None:
        self.mgr = mgr
        self.room = room
        self._state = KVPollState(KVPoll.Bootstrapping, label=f"sender room {room}")
        self.peer: Peer | None = None
        self.ready_msg: m.Ready | None = None
        self.failure_msg: m.Failed | None = None
        self.peer_cached_pages = 0             # D's prefix-cache claim (from its `want`)
        self.peer_prefix_hash: str | None = None
        self.peer_layout: KVShardLayout | None = None  # D's KV shard layout (its `want`)
        self.sent_for: KVShardLayout | None = None     # the layout the registration is cut for
        self.times: dict[str, float] = {}      # stage -> time.monotonic() (observability)

    def send(self, kv_indices: Sequence[int], *, prompt_len: int | None = None,
             first_token: int | None = None, first_logprob: float | None = None,
             first_top_logprobs: list[list[Any]] | None = None,
             cached_tokens: int = 0, skip_pages: int = 0,
             p_stages: dict[str, float] | None = None) -> None:
        """Register `kv_indices` (the prompt's pages after the first `skip_pages`, which D
        holds) for D's pull and announce them in `ready`."""
        if self._state.state.terminal:
            raise KVTransferError(f"room {self.room}: send() on a {self._state.state.name} sender")
        if self.ready_msg is not None:
            raise KVTransferError(f"room {self.room}: send() called twice")
        try:
            self.sent_for = self.peer_layout or self.mgr.layout
            self.ready_msg = self.mgr._register(self.room, list(kv_indices), prompt_len,
                                                first_token, first_logprob, cached_tokens,
                                                skip_pages, p_stages or {}, self.sent_for,
                                                first_top_logprobs=first_top_logprobs)
        except Exception as e:
            err = e if isinstance(e, KVTransferError) else KVTransferError(
                f"room {self.room}: preparing KV for transfer failed: {e}", status=500)
            self._fail(err, notify=True)
            return
        self._state.advance(KVPoll.Transferring)
        if self.peer is not None:
            self.mgr.channel.send(self.peer, self._ready_to_send())
            self.times["ready_sent"] = time.monotonic()

    def _ready_to_send(self) -> m.Ready:
        """`ready` with P's last stage (prefill done -> now) added to its p_stages."""
        msg, done = self.ready_msg, self.times.get("prefill_done")
        assert msg is not None
        if done is None:
            return msg
        return replace(msg, p_stages={**msg.p_stages, "send": max(0.0, time.monotonic() - done)})


    # --------------------------------------------------------------- manager callbacks
    def _on_want(self, peer: Peer, want: m.Want | None = None) -> None:
        self.peer = peer
        if want is not None and self.ready_msg is None:
            self.peer_cached_pages, self.peer_prefix_hash = want.cached_pages, want.prefix_hash
            if want.layout is not None:
                self.peer_layout = KVShardLayout.from_dict(want.layout)
        elif want is not None and want.layout is not None and self.sent_for is not None and \
                not self._state.state.terminal and \
                not same_layout(self.sent_for, KVShardLayout.from_dict(want.layout)):
            # registered (for P's own layout) before D said it is laid out otherwise: cut
            # D's pieces from that registration and register them instead
            layout = KVShardLayout.from_dict(want.layout)
            try:
                self.ready_msg = self.mgr._recut(self.room, self.ready_msg, self.sent_for,
                                                 layout)
                self.sent_for = layout
            except Exception as e:
                err = e if isinstance(e, KVTransferError) else KVTransferError(
                    f"room {self.room}: cutting KV for D's layout failed: {e}", status=500)
                self._fail(err, notify=False)
                self.mgr.channel.send(peer, self.failure_msg)
                return
        st = self._state.state
        if st == KVPoll.Bootstrapping:
            self._state.advance(KVPoll.WaitingForInput)
        if self.ready_msg is not None and not st.terminal:
            self.mgr.channel.send(peer, self._ready_to_send())
            self.times.setdefault("ready_sent", time.monotonic())
        elif self.failure_msg is not None:
            self.mgr.channel.send(peer, self.failure_msg)

    def _on_done(self, msg: m.Done) -> None:
        if msg.ok and self.ready_msg is not None:
            self.times["done"] = time.monotonic()
            self.mgr.engine.release(self.room)
            self._state.advance(KVPoll.Success)
            self.mgr._finish_sender(self)
        else:
            reason = msg.reason or "D reported the transfer failed"
            self._fail(KVTransferError(f"room {self.room}: {reason}", status=502), notify=False)

    def _on_failed(self, msg: m.Failed) -> None:
        self._fail(KVTransferError(f"room {self.room}: D failed: {msg.reason}",
                                   status=msg.status), notify=False)

    def _fail(self, exc: KVTransferError, *, notify: bool) -> None:
        if not self._state.fail(exc):
            return
        self.mgr.engine.release(self.room)
        self.failure_msg = m.Failed(room=self.room, reason=str(exc), status=exc.status)
        if notify and self.peer is not None:
            self.mgr.channel.send(self.peer, self.failure_msg)
        self.mgr._finish_sender(self)
