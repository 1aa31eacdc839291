"""Follower process (process_id > 0) of a multi-process P / D / colocated instance.

    run_follower(ctx, spec)
      health endpoint on ports.http (503 until ready)
      mesh over every device of the instance, the same ModelRunner, the same runner warmup
      P/D: its own transfer server (ports.transfer) and its own bootstrap registration with its
           rank tuple (zmq_addr = its own ports.zmq, so D's lookups by side channel find only
           the leader)
      control channel to the leader, then the lockstep loop until `stop` or the leader is gone

The loop executes the leader's commands in order (`pdtopo.runtime.distributed.leader`):
    forward    runner.forward(chunks); logits are discarded (the leader samples)
    p_register gather the room's pages (this process's shards) and await_pull them under the
               leader's uuid on this process's transfer server; with a `target` D layout
               unlike this instance's, register this process's pieces for it instead
               (disagg/reshard/arrays.py register_parts)
    p_recut    D's want came after p_register: cut that registration for D's layout and
               register the pieces under the new uuid
    p_release  drop that registration
    d_pull     look up P's process with this process's rank (bootstrap GET /route, by P's
               instance found from the leader's transfer address) and pull this process's shards
               on the engine's pull_executor (with `reshard`: this process's pieces from the P
               processes holding them); ack {"op": "pulled", ok, error} to the leader
    d_scatter  insert the room's pulled shards into the pool at the given pages (joining the
               pieces of a reshard into this process's shards first)
    d_drop     forget the room's pulled shards
    stop       leave the loop
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import signal
import threading
import time
from typing import Any

from pdtopo.config.pool_reserve import reserved_pages
from pdtopo.kernels import insert_kv_chunks, select_from_kv_caches
from pdtopo.runtime.api.http_auth import HttpGuard
from pdtopo.runtime.bootstrap.client import BootstrapClient, RegistrationKeeper
from pdtopo.runtime.bootstrap.protocol import Registration
from pdtopo.runtime.disagg.mixin_base import model_identity
from pdtopo.runtime.disagg.reshard.arrays import (
    piece_specs,
    pieces_of_d_process,
    pull_parts,
    register_parts,
)
from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, plan_pieces
from pdtopo.runtime.disagg.transport.base import PoolTransferSpec, wire_rows
from pdtopo.runtime.disagg.transport.resharding import scatter_pieces
from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine
from pdtopo.runtime.distributed.cluster import ClusterSpec
from pdtopo.runtime.distributed.control import ControlClient, lockstep_curve
from pdtopo.runtime.distributed.health import HealthServer
from pdtopo.runtime.engine.compilation_cache import enable_compilation_cache
from pdtopo.runtime.engine.mesh import build_mesh, local_process_index
from pdtopo.runtime.engine.model_runner import (
    ModelRunner,
    SeqChunk,
    warmup_kinds,
)

log = logging.getLogger("pdtopo.distributed.follower")

RANK_KEYS = ("tp_rank", "cp_rank", "dp_rank", "pp_rank")


class PeerRanks:
    """D follower: leader transfer address of a P instance -> the transfer address of the P
    process with this process's rank (cached; lookups run on a pull thread, not the loop)."""

    def __init__(self, client: Any, ranks: dict[str, int]):
        self.client = client
        self.ranks = {k: int(ranks.get(k, 0)) for k in RANK_KEYS}
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()

    def resolve(self, leader_transfer_addr: str) -> str:
        with self._lock:
            if leader_transfer_addr in self._cache:
                return self._cache[leader_transfer_addr]
        if self.client is None:
            raise RuntimeError("no bootstrap server in this process's plan: cannot find the "
                               "prefill process of my rank")
        entries = [e for e in self.client.list("prefill")
                   if e.get("transfer_addr") == leader_transfer_addr]
        if not entries:
            raise RuntimeError(f"no prefill registration with transfer_addr "
                               f"{leader_transfer_addr} in the bootstrap server")
        instance = entries[0]["instance_id"]
        entry = self.client.route("prefill", instance, self.ranks)
        addr = str(entry["transfer_addr"])
        with self._lock:
            self._cache[leader_transfer_addr] = addr
        log.info("prefill %s rank %s -> transfer %s", instance, self.ranks, addr)
        return addr


class Follower:
    """Executes the leader's commands on this process's shards (see the module docstring)."""

    def __init__(self, ctx: Any, runner: Any, engine: Any, control: Any, peers: PeerRanks | None,
                 kernels_impl: str = "auto"):

        self.ctx = ctx
        self.runner = runner
        self.engine = engine
        self.control = control
        self.peers = peers
        self.kernels_impl = kernels_impl
        self.pool = PoolTransferSpec.from_kv_caches(runner.kv_caches)
        self.layout = KVShardLayout.from_dict(runner.kv_layout())
        self.process_index = local_process_index(runner.mesh)
        self.pulls: dict[int, cf.Future] = {}
        # room -> (this process's pieces, every piece) of a reshard
        self.pieces: dict[int, tuple[list[Any], tuple[Any, ...]]] = {}
        self._resolver = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="peer-rank")
        self.num_commands = 0
        self.num_forward = 0
        self.stop_event = threading.Event()

    # ------------------------------------------------------------------ loop
    def loop(self) -> str:
        """Run until `stop`, a signal, or the leader going silent; returns why it ended."""
        while not self.stop_event.is_set():
            msg = self.control.recv(0.1)
            if msg is None:
                if not self.control.leader_alive():
                    return "leader silent"
                continue
            if msg.get("op") == "stop":
                return "leader said stop"
            self.num_commands += 1
            try:
                self.handle(msg)
            except Exception as exc:
                log.exception("command %s failed", msg.get("op"))
                self.control.send({"op": "error", "message": f"{msg.get('op')}: {exc}",
                                   "command": msg.get("op"), "room": msg.get("room")})
        return "signal"

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise ValueError(f"unknown lockstep command {op!r}")
        handler(msg)

    # ------------------------------------------------------------------ commands
    def _op_forward(self, msg: dict[str, Any]) -> None:

        chunks = [SeqChunk(list(t), int(s), list(p)) for t, s, p in msg["chunks"]]
        self.runner.forward(chunks)
        self.num_forward += 1

    def _op_p_register(self, msg: dict[str, Any]) -> None:

        packed = select_from_kv_caches(self.runner.kv_caches, msg["page_ids"], padded=True)
        if msg.get("target"):
            pieces = plan_pieces(self.layout, KVShardLayout.from_dict(msg["target"]))
            register_parts(self.engine, int(msg["room"]), packed, self.layout, pieces,
                           self.process_index, int(msg["uuid"]), float(msg["expire_s"]))
            return
        self.engine.register(int(msg["room"]), packed, float(msg["expire_s"]),
                             uuid=int(msg["uuid"]))

    def _op_p_recut(self, msg: dict[str, Any]) -> None:
        room = int(msg["room"])
        packed = self.engine.registered_arrays(room)
        if packed is None:
            raise RuntimeError(f"room {room}: no registration to cut for D's layout")
        self.engine.release(room)
        pieces = plan_pieces(self.layout, KVShardLayout.from_dict(msg["target"]))
        register_parts(self.engine, room, packed, self.layout, pieces, self.process_index,
                       int(msg["uuid"]), float(msg["expire_s"]))

    def _op_p_release(self, msg: dict[str, Any]) -> None:
        self.engine.release(int(msg["room"]))

    def _op_d_pull(self, msg: dict[str, Any]) -> None:
        room = int(msg["room"])
        deadline = time.monotonic() + float(msg["timeout_s"])
        if msg.get("reshard"):
            self._pull_pieces(room, msg, deadline)
            return
        specs = self.pool.packed_specs(int(msg["num_pages"]))

        def job() -> Any:
            addr = self.peers.resolve(str(msg["peer"])) if self.peers else str(msg["peer"])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("KV deadline passed while looking up the prefill peer")
            return self.engine.pull(addr, int(msg["uuid"]), specs, remaining, room=room).result()

        fut = self._resolver.submit(job)
        self.pulls[room] = fut

        def report(f: cf.Future) -> None:
            exc = f.exception()
            self.control.send({"op": "pulled", "room": room, "ok": exc is None,
                               "error": None if exc is None else str(exc)})

        fut.add_done_callback(report)

    def _pull_pieces(self, room: int, msg: dict[str, Any], deadline: float) -> None:
        """d_pull of a reshard: this process's pieces from the P processes holding them."""
        info = msg["reshard"]
        pool, count = self.pool, int(msg["num_pages"])
        try:
            pieces = plan_pieces(KVShardLayout.from_dict(info["p_layout"]), self.layout)
            mine = pieces_of_d_process(pieces, self.process_index)

            def specs_of(group: list[Any]) -> list[Any]:
                return piece_specs(wire_rows(count), pool.page_size, pool.shape[3], pool.dtype,
                                   pool.num_entries, group, pool.sharding, self.layout)

            fut = pull_parts(self.engine, room, list(info["p_addrs"]), int(msg["uuid"]), mine,
                             self.process_index, pool.num_entries, specs_of,
                             max(0.001, deadline - time.monotonic()))
        except Exception as exc:
            fut = cf.Future()
            fut.set_exception(exc)
            mine, pieces = [], ()
        self.pulls[room] = fut
        self.pieces[room] = (mine, pieces)

        def report(f: cf.Future) -> None:
            exc = f.exception()
            self.control.send({"op": "pulled", "room": room, "ok": exc is None,
                               "error": None if exc is None else str(exc)})

        fut.add_done_callback(report)

    def _op_d_scatter(self, msg: dict[str, Any]) -> None:

        room = int(msg["room"])
        fut = self.pulls.pop(room, None)
        pieces = self.pieces.pop(room, None)
        if fut is None or not fut.done() or fut.exception() is not None:
            raise RuntimeError(f"room {room}: the leader scatters KV this process has not "
                               "pulled; this process's shards of the request are missing")
        packed, skip = fut.result(), int(msg.get("skip", 0))
        if pieces is not None:
            self.runner.kv_caches = scatter_pieces(
                self.runner.kv_caches, packed, *pieces, self.layout, self.pool, msg["page_ids"],
                skip, lambda kv, p, ids, first: insert_kv_chunks(
                    kv, p, ids, impl=self.kernels_impl, first_row=first))
            return
        # the first `skip` rows: pages D's prefix cache already holds (pulled, not written)
        self.runner.kv_caches = insert_kv_chunks(self.runner.kv_caches, packed,
                                                 msg["page_ids"], impl=self.kernels_impl,
                                                 first_row=skip)

    def _op_d_drop(self, msg: dict[str, Any]) -> None:
        self.pulls.pop(int(msg["room"]), None)
        self.pieces.pop(int(msg["room"]), None)

    def state(self) -> dict[str, Any]:
        return {"num_commands": self.num_commands, "num_forward": self.num_forward,
                "control_curve": self.control.curve,
                "pd_pulls": len(self.pulls),
                "pd_registered_kv": self.engine.num_registered() if self.engine else 0,
                "attention": self.runner.attention_path().label}

    def close(self) -> None:
        self._resolver.shutdown(wait=False, cancel_futures=True)


def follower_registration(ctx: Any, runner: Any, transfer_addr: str):

    cfg = ctx.cfg
    http = ctx.ports.get("http")
    layout = runner.kv_layout()
    return Registration(
        role=ctx.role, instance_id=str(ctx.process.get("instance_id", ctx.name)), **ctx.rank,
        transfer_addr=transfer_addr, zmq_addr=f"{ctx.address}:{int(ctx.ports.get('zmq') or 1)}",
        http_addr=f"{ctx.address}:{http}" if http else None,
        page_size=runner.page_size, kv_dtype=layout["dtype"],
        model=model_identity(cfg),
        kv_layout={k: (list(v) if isinstance(v, tuple) else v) for k, v in layout.items()},
        mesh_meta={"tp": int(ctx.process.get("mesh", {}).get("tp", 1)),
                   "num_processes": int(layout.get("num_processes", 1))})


def run_follower(ctx: Any, spec: ClusterSpec) -> int:
    """The follower's whole life (JAX cluster already initialized). Returns an exit code."""

    cfg = ctx.cfg
    holder: dict[str, Follower] = {}
    health = None
    if ctx.ports.get("http"):
        health = HealthServer(ctx.bind_host, int(ctx.ports["http"]),
                              lambda: holder["f"].state() if "f" in holder else {},
                              guard=HttpGuard.from_context(ctx))
    stop = threading.Event()

    def on_signal(sig: int, _frame: Any) -> None:
        log.info("signal %d: stopping", sig)
        stop.set()
        if "f" in holder:
            holder["f"].stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = keeper = bootstrap = control = follower = None
    try:
        settings = ctx.settings
        enable_compilation_cache(settings.launcher.compilation_cache_dir)
        tp = int(ctx.process.get("mesh", {}).get("tp", 1))
        mesh = build_mesh(tp)
        log.info("follower %s: mesh tp=%d on %s", ctx.name, tp,
                 [str(d) for d in mesh.devices.flat])
        # the leader's pool size: every process of the instance keeps the same reserve
        runner = ModelRunner(cfg.model, settings.engine, mesh,
                             reserve_pages=reserved_pages(settings, ctx.role))
        runner.warmup(**warmup_kinds(ctx.role))  # the same compiled steps as the leader
        pd = ctx.role in ("prefill", "decode")
        if pd:
            engine = JaxTransferKVEngine.from_context(ctx)
            if ctx.bootstrap_url:
                bootstrap = BootstrapClient(ctx.bootstrap_url, ctx.token)
                keeper = RegistrationKeeper(
                    bootstrap, follower_registration(ctx, runner, engine.address),
                    settings.bootstrap.heartbeat_interval_s).start()
                timeout = settings.bootstrap.register_timeout_s
                if not keeper.wait_registered(timeout):
                    raise RuntimeError(f"could not register with the bootstrap server "
                                       f"{bootstrap.url} within {timeout:g}s")
        leader_host = ctx.settings.server.bind_host or spec.leader_entry.get("address")
        control = ControlClient(spec.control_addr, spec.process_id, curve=lockstep_curve(
            settings.disaggregation.side_channel_curve, leader_host, ctx.token))
        peers = PeerRanks(bootstrap, ctx.rank) if ctx.role == "decode" else None
        follower = Follower(ctx, runner, engine, control, peers,
                            kernels_impl=settings.kernels.impl)
        holder["f"] = follower
        if stop.is_set():
            return 0
        if health is not None:
            health.status = "ok"
        log.info("follower %s (process %d of instance %s) in lockstep with %s", ctx.name,
                 spec.process_id, spec.instance_id, spec.control_addr)
        why = follower.loop()
        log.info("follower %s leaving the lockstep loop: %s", ctx.name, why)
        return 0 if why in ("leader said stop", "signal") else 1
    except Exception as exc:
        log.exception("follower %s failed", ctx.name)
        if health is not None:
            health.status, health.error = "failed", f"{type(exc).__name__}: {exc}"
        return 1
    finally:
        for closer in (follower, control, keeper, engine, bootstrap, health):
            if closer is not None:
                try:
                    (closer.stop if isinstance(closer, RegistrationKeeper) else closer.close)()
                except Exception:
                    log.exception("closing %r failed", closer)
