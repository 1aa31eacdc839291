"""JaxTransferKVReceiver: D's side of one room (docs/protocol.md#abstract-roles).

The manager (manager.py) creates it (sending `want` to P) and drives it from `progress()`:

    init(pages)  -> the pages for the rest of the prompt's KV
    P's ready    -> _on_ready; with the pages too, the announcement is checked against this pool
                    and the pull starts on the engine's pull_executor -> Transferring
    _progress    -> the pull done: scatter into the pool (this thread owns it), `done` to P
                    -> Success; or the pull failed, or kv_timeout_s passed -> Failed
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, same_layout
from pdtopo.runtime.disagg.transport import messages as m
from pdtopo.runtime.disagg.transport.base import BaseKVReceiver, KVTransferError, check_packed_meta
from pdtopo.runtime.disagg.transport.endpoint import RoomEndpoint, check_endpoint
from pdtopo.runtime.disagg.transport.kvpoll import KVPoll, KVPollState
from pdtopo.runtime.engine.step_errors import device_state_lost, is_device_error

log = logging.getLogger(__name__)


class JaxTransferKVReceiver(RoomEndpoint, BaseKVReceiver):
    """D side of one room (create with `JaxTransferKVManager.create_receiver`)."""

    def __init__(self, mgr: Any, room: int, bootstrap_addr: str,
                 cached_pages: int = 0, prefix_hash: str | None = None) -> None:
        self.mgr = mgr
        self.room = room
        self.bootstrap_addr = check_endpoint(bootstrap_addr, "bootstrap_host:bootstrap_port")
        self._state = KVPollState(KVPoll.Bootstrapping, label=f"receiver room {room}")
        # The KV timeout runs from the request's arrival; init() extends it when pages only
        # came later (time spent waiting for free pages is queueing, not a lost transfer).
        self.deadline = time.monotonic() + mgr.kv_timeout_s
        self.page_ids: list[int] | None = None
        self.ready_info: m.Ready | None = None
        self._future = None
        self.cached_pages = int(cached_pages)   # leading prompt pages D holds (prefix cache)
        self.pulled_pages = 0
        self.pulled_bytes = 0
        self._drop = 0                           # leading pulled pages D already holds
        self.times: dict[str, float] = {}        # stage -> time.monotonic() (observability)
        # a reshard: (this process's pieces, every D process's pieces)
        self._reshard: tuple[list[Any], tuple[Any, ...]] | None = None
        self.peer = mgr.channel.send_to(self.bootstrap_addr, m.Want(
            room=room, cached_pages=self.cached_pages,
            prefix_hash=prefix_hash if self.cached_pages else None,
            layout=mgr.layout.to_dict()))

    def init(self, kv_indices: Sequence[int]) -> None:
        """Give the pages preallocated for this room's KV (in the order P sends them): every
        prompt page after the `cached_pages` D holds."""
        if self.page_ids is not None:
            raise KVTransferError(f"room {self.room}: init() called twice")
        self.page_ids = [int(i) for i in kv_indices]
        self.times["pages"] = time.monotonic()
        self.deadline = max(self.deadline, time.monotonic() + self.mgr.kv_timeout_s)
        if self._state.state.terminal:
            return
        self._state.advance(KVPoll.WaitingForInput)
        if self.ready_info is not None:
            self._start_pull()


    # --------------------------------------------------------------- manager callbacks
    def _on_ready(self, msg: m.Ready) -> None:
        if self.ready_info is not None or self._state.state.terminal:
            return  # P re-sent ready (answering a repeated want): never pull a uuid twice
        self.ready_info = msg
        self.times["ready"] = time.monotonic()
        if self.page_ids is not None:
            self._start_pull()

    def _on_failed(self, msg: m.Failed) -> None:
        self._fail(KVTransferError(f"room {self.room}: P failed: {msg.reason}",
                                   status=msg.status or 502), notify=False)

    def _start_pull(self) -> None:
        msg, pages = self.ready_info, self.page_ids
        assert msg is not None and pages is not None
        try:
            main = self.mgr.args.main
            announced = [p for p in msg.pools if p.pool_type == main.pool_type]
            if len(msg.pools) != 1 or len(announced) != 1:
                raise KVTransferError(
                    f"room {self.room}: P announced pools {[p.name for p in msg.pools]}; this D "
                    f"transfers exactly one {main.pool_type} pool", status=500)
            if not 0 <= msg.skip_pages <= self.cached_pages:
                raise KVTransferError(
                    f"room {self.room}: P skipped {msg.skip_pages} leading pages, D holds "
                    f"{self.cached_pages}", status=500)
            # P sent `extra` pages D already holds (D's want reached P after P's send): they
            # are pulled and dropped before the scatter, never written over D's cached pages
            extra = self.cached_pages - msg.skip_pages
            count = len(pages) + extra
            if announced[0].page_count != count:
                raise KVTransferError(
                    f"room {self.room}: P sends {announced[0].page_count} pages, D preallocated "
                    f"{len(pages)} (after the {self.cached_pages} it holds; P skipped "
                    f"{msg.skip_pages})", status=500)
            p_layout = self.mgr.layout if msg.layout is None else \
                KVShardLayout.from_dict(msg.layout)
            reshard = not same_layout(p_layout, self.mgr.layout)
            if reshard:
                self.mgr._check_reshard_meta(announced[0], p_layout, count)
            else:
                check_packed_meta(announced[0], main.packed_meta(count))
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise KVTransferError(f"room {self.room}: KV deadline passed before the pull",
                                      status=504)
            self._drop = extra
            self.pulled_pages = count
            self.times["pull_start"] = time.monotonic()
            if reshard:
                self._future, mine, pieces = self.mgr._pull_reshard(
                    msg, p_layout, count, remaining, room=self.room)
                self._reshard = (mine, pieces)
            else:
                self._future = self.mgr._pull(msg, count, remaining, room=self.room)
            if hasattr(self._future, "add_done_callback"):  # the pull thread's own end time
                self._future.add_done_callback(self._pulled)
        except Exception as e:  # whatever P announced, the scheduler thread goes on
            err = e if isinstance(e, KVTransferError) else KVTransferError(
                f"room {self.room}: cannot pull what P announced: {e!r}", status=500)
            self._fail(err, notify=True)
            return
        self._state.advance(KVPoll.Transferring)

    def _progress(self, now: float) -> None:
        st = self._state.state
        if st.terminal:
            return
        if self._future is not None:
            if not self._future.done():
                return
            exc = self._future.exception()
            if exc is not None:
                err = exc if isinstance(exc, KVTransferError) else KVTransferError(
                    f"room {self.room}: {exc}", status=502)
                self._fail(err, notify=True)
                return
            self.times.setdefault("pull_end", now)
            try:
                packed = self._future.result()
                self.pulled_bytes = sum(int(a.nbytes) for a in packed)
                if self._reshard is not None:
                    self.mgr._scatter_reshard(packed, *self._reshard, self.page_ids,
                                              room=self.room, skip=self._drop)
                else:
                    self.mgr._scatter(packed, self.page_ids, room=self.room, skip=self._drop)
            except Exception as e:
                if is_device_error(e) or device_state_lost(
                        getattr(self.mgr.runner, "kv_caches", None) or ()):
                    raise  # the pool went with it: the scheduler ends the process
                self._fail(KVTransferError(f"room {self.room}: inserting the pulled KV into "
                                           f"the pool failed: {e}", status=500), notify=True)
                return
            self._future = None
            self.times["scattered"] = time.monotonic()
            self.mgr.channel.send(self.peer, m.Done(room=self.room, ok=True))
            self._state.advance(KVPoll.Success)
            self.mgr._finish_receiver(self)
        elif now >= self.deadline:
            what = "no ready from P" if self.ready_info is None else "no free pages at D"
            self._fail(KVTransferError(
                f"room {self.room}: KV from P at {self.bootstrap_addr} did not arrive within "
                f"kv_timeout_s={self.mgr.kv_timeout_s:g} ({what})", status=504), notify=True)

    def _pulled(self, _future: Any) -> None:
        self.times.setdefault("pull_end", time.monotonic())  # a float store: thread-safe

    def _fail(self, exc: KVTransferError, *, notify: bool) -> None:
        if not self._state.fail(exc):
            return
        log.warning("%s", exc)
        if notify:
            self.mgr.channel.send(self.peer, m.Failed(room=self.room, reason=str(exc),
                                                      status=exc.status))
        self.mgr._finish_receiver(self)
