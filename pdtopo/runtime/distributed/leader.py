"""Leader (process 0) of a multi-process instance: drives its followers in lockstep.

The leader is an ordinary server (HTTP API, scheduler, side channel, first token, `ready`).
`attach_leader(ctx, runner)` (called by `make_scheduler`) binds the control channel, waits for
every follower's hello and returns a `LeaderRunner`, which the scheduler uses like the runner:

    forward(chunks)  -> broadcast {"op": "forward", chunks} then run it here; every process
                        launches the same jitted step on its devices (the mesh spans them all),
                        so the step's collectives line up; sampling uses the local logits only
    kv_mirror        -> `LeaderMirror`, which the KV manager (disagg/transport/manager.py)
                        calls so that each follower does the same pool operation on its own shards:
        register(room, pages, uuid, expiry, target)
                                             P: gather + await_pull under the leader's uuid
                                             (with a D layout `target` unlike P's: cut and
                                             register its pieces, reshard/arrays.py)
        recut(room, uuid, expiry, target)    P: D's want came after the registration: cut
                                             the registered shards for D's layout instead
        release(room)                        P: drop the registration (done / failure)
        pull(room, peer, uuid, n, timeout, local_future, reshard) -> Future
                                             D: every follower pulls its shards from its P peer
                                             (same rank), or with `reshard` its pieces from the
                                             P processes holding them; the Future completes
                                             when the leader's own pull and every follower's
                                             `pulled` ack are in
        scatter(room, pages)                 D: insert the pulled pages into the pool
        drop(room)                           D: forget the room's pulled arrays (failure / end)

Commands are broadcast from the scheduler thread only, in the order of execution here, so
every process runs the same sequence of global computations.

A follower that dies leaves the instance unable to run a step (its collectives would wait
forever): the control channel reports the closed connection, the leader ends every request in
flight with a retryable 503 and exits (`FOLLOWER_LOST_EXIT`); the followers see the leader's
connection close and exit too, and supervisord starts the whole instance again
(`exit_on_follower_loss`, installed by `make_scheduler`).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
from typing import Any

from pdtopo.runtime.disagg.transport.base import KVTransferError
from pdtopo.runtime.distributed.cluster import ClusterSpec
from pdtopo.runtime.distributed.control import ControlServer, lockstep_curve
from pdtopo.runtime.engine.request import FinishReason, ReqOutput
from pdtopo.runtime.worker_threads import server_fault

log = logging.getLogger("pdtopo.distributed.leader")

JOIN_TIMEOUT_S = 300.0      # followers build the same model; they say hello when warmed up
ACK_GRACE_S = 5.0           # a follower's pull ack may come this late after the pull deadline


class _PullGroup:
    """D: the leader's own pull plus one ack per follower, as one Future."""

    def __init__(self, room: int, followers: set[int], local: cf.Future, deadline: float):
        self.room = room
        self.future: cf.Future = cf.Future()
        self.waiting = set(followers)
        self.deadline = deadline
        self._lock = threading.Lock()
        self._local_result: Any = None
        self._local_done = False
        local.add_done_callback(self._on_local)

    def _settle(self, result: Any = None, exc: BaseException | None = None) -> None:
        if self.future.done():
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def _on_local(self, fut: cf.Future) -> None:
        with self._lock:
            exc = fut.exception()
            if exc is not None:
                self._settle(exc=exc)
                return
            self._local_result, self._local_done = fut.result(), True
            if not self.waiting:
                self._settle(self._local_result)

    def ack(self, pid: int, ok: bool, error: str | None) -> None:
        with self._lock:
            if not ok:
                self._settle(exc=KVTransferError(
                    f"room {self.room}: process {pid} of this decode instance could not pull "
                    f"its KV shards: {error}", status=502))
                return
            self.waiting.discard(pid)
            if not self.waiting and self._local_done:
                self._settle(self._local_result)

    def check(self, now: float) -> None:
        if now >= self.deadline:
            with self._lock:
                self._settle(exc=KVTransferError(
                    f"room {self.room}: processes {sorted(self.waiting)} of this decode "
                    f"instance did not report their KV pull in time", status=504))


class LeaderMirror:
    """Replays pool operations on the followers (see the module docstring)."""

    def __init__(self, server: ControlServer | None, followers: set[int]):
        self.server = server
        self.followers = set(followers)
        self._lock = threading.Lock()
        self._groups: dict[int, _PullGroup] = {}
        self._registered: set[int] = set()   # P rooms the followers hold
        # (room, process, why): P rooms a follower could not register (read by the KV manager)
        self.failed_rooms: queue.Queue[tuple[int, int, str]] = queue.Queue()
        self._closed = False

    def attach(self, server: ControlServer) -> None:
        self.server = server

    on_lost: Any = None  # callable(process_id): what the process does when a follower dies

    def follower_lost(self, process_id: int) -> None:
        """The control channel's report of a dead follower (its I/O thread)."""
        if self._closed:
            return
        if self.on_lost is not None:
            self.on_lost(process_id)
        else:
            log.error("lockstep: follower process %d died; exiting so that the instance "
                      "restarts as a whole", process_id)
            os._exit(FOLLOWER_LOST_EXIT)

    def broadcast(self, msg: dict[str, Any]) -> None:
        assert self.server is not None
        self.server.broadcast(msg)

    # ------------------------------------------------------------------ P
    def register(self, room: int, page_ids: list[int], uuid: int, expire_s: float,
                 target: dict[str, Any] | None = None) -> None:
        self._registered.add(room)
        self.broadcast({"op": "p_register", "room": room, "page_ids": list(page_ids),
                        "uuid": int(uuid), "expire_s": float(expire_s), "target": target})

    def recut(self, room: int, uuid: int, expire_s: float, target: dict[str, Any]) -> None:
        """P: cut the room's registered shards for D layout `target` (D's want came after the
        registration) and register the pieces under `uuid`."""
        self.broadcast({"op": "p_recut", "room": room, "uuid": int(uuid),
                        "expire_s": float(expire_s), "target": target})

    def release(self, room: int) -> None:
        if room in self._registered:
            self._registered.discard(room)
            self.broadcast({"op": "p_release", "room": room})

    # ------------------------------------------------------------------ D
    def pull(self, room: int, peer: str, uuid: int, num_pages: int, timeout_s: float,
             local: cf.Future, reshard: dict[str, Any] | None = None) -> cf.Future:
        group = _PullGroup(room, self.followers, local,
                           time.monotonic() + timeout_s + ACK_GRACE_S)
        with self._lock:
            self._groups[room] = group
        self.broadcast({"op": "d_pull", "room": room, "peer": peer, "uuid": int(uuid),
                        "num_pages": int(num_pages), "timeout_s": float(timeout_s),
                        "reshard": reshard})
        return group.future

    def scatter(self, room: int | None, page_ids: list[int], skip: int = 0) -> None:
        """Followers scatter their pulled shards of `room` into `page_ids`, after dropping the
        `skip` leading pages (pages P sent that D's prefix cache already holds)."""
        if room is None:
            raise KVTransferError("multi-process scatter needs the room (followers key their "
                                  "pulled shards by room)", status=500)
        with self._lock:
            self._groups.pop(room, None)
        self.broadcast({"op": "d_scatter", "room": room, "page_ids": list(page_ids),
                        "skip": int(skip)})

    def drop(self, room: int) -> None:
        with self._lock:
            group = self._groups.pop(room, None)
        if group is not None:
            self.broadcast({"op": "d_drop", "room": room})

    # ------------------------------------------------------------------ I/O thread callbacks
    def on_message(self, pid: int, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "pulled":
            with self._lock:
                group = self._groups.get(int(msg["room"]))
            if group is not None:
                group.ack(pid, bool(msg.get("ok")), msg.get("error"))
        elif op == "error":
            log.error("follower process %d: %s", pid, msg.get("message"))
            room = msg.get("room")
            if msg.get("command") in ("p_register", "p_recut") and isinstance(room, int):
                # that process's part of the room's KV will never be pulled: the KV manager
                # fails the room at once (and tells D) instead of letting D's pull time out
                self.failed_rooms.put((room, pid, str(msg.get("message"))))
        else:
            log.warning("unexpected message from follower process %d: %r", pid, msg)

    def on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            groups = list(self._groups.values())
        for g in groups:
            g.check(now)

    def close(self) -> None:
        """Tell the followers to stop and close the channel (idempotent)."""
        if self._closed or self.server is None:
            return
        self._closed = True
        try:
            self.broadcast({"op": "stop"})
            time.sleep(0.2)  # let the I/O thread flush the stop command
        finally:
            self.server.close()


class LeaderRunner:
    """The runner as the scheduler sees it on a leader: forward is broadcast first."""

    def __init__(self, runner: Any, mirror: LeaderMirror):
        self._runner = runner
        self.kv_mirror = mirror

    @property
    def kv_caches(self) -> list[Any]:
        return self._runner.kv_caches

    @kv_caches.setter
    def kv_caches(self, value: list[Any]) -> None:
        self._runner.kv_caches = value

    supports_feed = False  # followers replay host chunks: no tokens fed on the device

    def forward(self, chunks: list[Any], padded: bool = False) -> Any:
        self.kv_mirror.broadcast({"op": "forward", "chunks": [
            [[int(t) for t in c.token_ids], int(c.start_pos), [int(p) for p in c.page_ids]]
            for c in chunks]})
        return self._runner.forward(chunks, padded=padded)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


FOLLOWER_LOST_EXIT = 75  # the leader's exit status when a follower died (supervisord restarts)
_ANSWER_GRACE_S = 0.5    # time the HTTP layer gets to answer the ended requests before exit


def exit_on_follower_loss(scheduler: Any) -> None:
    """On a leader: when a follower dies, end every request in flight with a retryable 503
    (the scheduler thread may be stuck in a step the dead follower never joins, so the outputs
    go straight to the requests' sinks), give the HTTP layer a moment to answer, and exit."""
    mirror = getattr(scheduler.runner, "kv_mirror", None)
    if mirror is None:
        return

    def on_lost(process_id: int) -> None:
        log.error("lockstep: follower process %d died; ending the requests in flight and "
                  "exiting so that the instance restarts as a whole", process_id)
        reason = FinishReason.abort(
            f"process {process_id} of this multi-process instance died; the instance "
            "restarts (retry the request)", 503)
        for req in _live_requests(scheduler):
            try:
                req.sink.emit(ReqOutput(rid=req.rid, new_token_ids=[],
                                        num_output_tokens=len(req.output_ids),
                                        prompt_tokens=len(req.prompt_ids), finished=True,
                                        finish_reason=reason))
            except Exception:  # noqa: BLE001 - last words; the exit below must happen
                log.exception("could not end %s", req.rid)
        time.sleep(_ANSWER_GRACE_S)
        os._exit(FOLLOWER_LOST_EXIT)

    mirror.on_lost = on_lost


def _live_requests(scheduler: Any) -> list[Any]:
    for _ in range(10):  # the scheduler thread may change the dict while we copy it
        try:
            return list(scheduler.reqs.values())
        except RuntimeError:
            time.sleep(0.001)
    return []


def attach_leader(ctx: Any, runner: Any) -> Any:
    """`runner` unchanged for a single-process instance; else the lockstep `LeaderRunner`
    once every follower joined (raises after JOIN_TIMEOUT_S)."""
    spec = ClusterSpec.from_context(ctx)
    if spec is None:
        return runner
    if not spec.leader:
        raise RuntimeError(f"process {ctx.name!r} is a follower (process_id "
                           f"{spec.process_id}); followers run no scheduler")
    mirror = LeaderMirror(None, set(range(1, spec.num_processes)))
    port = spec.control_addr.rpartition(":")[2]
    bind = f"{ctx.bind_host}:{port}"
    curve = lockstep_curve(ctx.settings.disaggregation.side_channel_curve, ctx.bind_host,
                           ctx.token)
    server = ControlServer(bind, spec.num_processes - 1, mirror.on_message,
                           on_tick=mirror.on_tick, on_follower_lost=mirror.follower_lost,
                           curve=curve, fault=server_fault(ctx.settings, "lockstep_control"))
    mirror.attach(server)
    log.info("lockstep: waiting for %d follower(s) on %s%s", spec.num_processes - 1, bind,
             " (CURVE)" if curve is not None else "")
    if not server.wait_followers(JOIN_TIMEOUT_S):
        server.close()
        raise RuntimeError(
            f"instance {spec.instance_id!r}: not every follower process joined the lockstep "
            f"channel {bind} (ports.control) within {JOIN_TIMEOUT_S:g}s")
    atexit.register(mirror.close)
    return LeaderRunner(runner, mirror)
