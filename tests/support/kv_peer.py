"""A P or D process for the KV data-plane process tests and the transfer benchmark.

    python tests/support/kv_peer.py --role prefill|decode [--tp N] [--zmq-port P] ...

It builds a paged KV pool ([num_pages, page_size, heads, head_dim] x 2*layers, sharded over
"tp"), a JaxTransferKVManager (engine + side channel) and runs a scheduler-like loop on the main
thread: drain JSON commands from stdin, mgr.progress(), answer on stdout (one JSON per line).
P's pool is filled with `fill_values` (distinct exact float32 values); D's starts at zero.

Commands: info | sender room | send room pages [first_token prompt_len] | receiver room p pages
| state room | wait room timeout | stats | dump pages | register_raw room mb chunk_mb | quit.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import queue
import sys
import threading
import time

import numpy as np


def fill_values(shape: tuple[int, ...], entry: int) -> np.ndarray:
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float32) + np.float32(entry * n)).reshape(shape)


class PeerProcess:
    """Test-side handle: start `kv_peer.py` as a subprocess and talk JSON lines to it."""

    def __init__(self, role: str, *extra: str, devices: int = 1, log_path=None,
                 startup_timeout: float = 120) -> None:
        import os
        import subprocess
        from pathlib import Path

        env = dict(os.environ)
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        repo = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", role, *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env, cwd=str(repo))
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._ids = 0
        self.info = self._read(lambda d: d.get("event") == "started", startup_timeout)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            try:
                self._lines.put(json.loads(line))
            except ValueError:
                pass
        self._lines.put(None)

    def _read(self, match, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the peer within {timeout} s")
            try:
                d = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if d is None:
                raise RuntimeError(f"peer exited (rc={self.proc.poll()})")
            if match(d):
                return d

    def call(self, cmd: str, timeout: float = 60, **kw) -> dict:
        self._ids += 1
        cid = self._ids
        self.proc.stdin.write(json.dumps({"id": cid, "cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        d = self._read(lambda d: d.get("id") == cid, timeout)
        if d.get("error") and "state" not in d:
            raise RuntimeError(f"peer {cmd} failed: {d['error']}")
        return d

    def wait(self, room: int, wait_s: float) -> dict:
        """Until the room's transfer is Success/Failed (or wait_s passed): its state."""
        return self.call("wait", timeout=wait_s + 60, room=room, wait_s=wait_s)

    def dump(self, pages) -> np.ndarray:
        d = self.call("dump", pages=list(pages))
        return np.load(io.BytesIO(base64.b64decode(d["npy"])))

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=10)
                self.proc.wait(timeout=10)
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self._log is not None and hasattr(self._log, "close"):
            self._log.close()


def _reader(q: queue.Queue) -> None:
    for line in sys.stdin:
        line = line.strip()
        if line:
            q.put(line)
    q.put(None)


def _out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--zmq-port", type=int, default=0)
    ap.add_argument("--transfer-port", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--num-pages", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--model-kv-heads", type=int, default=0,
                    help="the model's KV heads (default --heads); fewer: each is repeated "
                         "heads / model_kv_heads times in the pool, as replication does")
    ap.add_argument("--kv-timeout", type=float, default=30)
    ap.add_argument("--expiry", type=float, default=60)
    ap.add_argument("--sockets", type=int, default=2)
    ap.add_argument("--fault-prob", type=float, default=0.0)
    ap.add_argument("--d2h-staging", action="store_true",
                    help="P stages its copies in host memory (mode B)")
    args = ap.parse_args()

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pdtopo.runtime.disagg.transport.base import KVArgs, PoolTransferSpec
    from pdtopo.runtime.disagg.transport.manager import JaxTransferKVManager
    from pdtopo.runtime.disagg.transport.side_channel import SideChannel
    from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine

    mesh = Mesh(np.array(jax.devices()[: args.tp]), ("tp",))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
    shape = (args.num_pages, args.page_size, args.heads, args.head_dim)
    n_entries = 2 * args.layers
    model_heads = args.model_kv_heads or args.heads
    rep = args.heads // model_heads
    if args.role == "prefill":
        base = (args.num_pages, args.page_size, model_heads, args.head_dim)
        host = [np.repeat(fill_values(base, e), rep, axis=2) for e in range(n_entries)]
    else:
        host = [np.zeros(shape, np.float32) for _ in range(n_entries)]

    class Runner:
        kv_caches = [jax.device_put(h, sharding) for h in host]

        @staticmethod
        def kv_layout() -> dict:
            return {"num_entries": n_entries, "page_size": args.page_size,
                    "kv_heads": args.heads, "model_kv_heads": model_heads,
                    "head_dim": args.head_dim, "dtype": "float32", "tp": args.tp,
                    "num_processes": 1, "shard_processes": [0] * args.tp}

    runner = Runner()
    engine = JaxTransferKVEngine("127.0.0.1", args.transfer_port, transfer_sockets=args.sockets,
                                 transfer_size_mb=1, pull_workers=4,
                                 fault_injection_prob=args.fault_prob, seed=0,
                                 sweep_interval_s=0.25, d2h_staging=args.d2h_staging)
    bind = f"127.0.0.1:{args.zmq_port}" if args.role == "prefill" else None
    channel = SideChannel(bind=bind, max_bytes=65536, name=args.role)
    kv_args = KVArgs(pools=[PoolTransferSpec.from_kv_caches(runner.kv_caches)])
    mgr = JaxTransferKVManager(kv_args, engine=engine, channel=channel,
                               kv_timeout_s=args.kv_timeout, sender_expiry_s=args.expiry,
                               owns_transport=True)
    mgr.register_runner(runner)
    objs: dict[int, object] = {}
    waiters: list[tuple[int, float, float, int]] = []  # (room, deadline, start, id)
    raw_regs: dict[int, list] = {}

    def state(room: int) -> dict:
        o = objs.get(room)
        if o is None:
            return {"state": None}
        st = o._state.state
        err = o.failure_exception()
        return {"state": st.name, "error": None if err is None else str(err),
                "status": getattr(err, "status", None)}

    _out({"event": "started", "transfer_addr": engine.address, "zmq_addr": channel.address,
          "devices": len(jax.devices())})
    cmds: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(cmds,), daemon=True).start()
    try:
        while True:
            mgr.progress()
            now = time.monotonic()
            for w in list(waiters):
                room, deadline, start, cid = w
                st = state(room)
                if st["state"] in ("Success", "Failed") or now >= deadline:
                    waiters.remove(w)
                    _out({"id": cid, "elapsed": now - start, **st})
            try:
                line = cmds.get(timeout=0.002)
            except queue.Empty:
                continue
            if line is None:
                break
            c = json.loads(line)
            cid, cmd = c.get("id"), c["cmd"]
            try:
                if cmd == "quit":
                    _out({"id": cid, "ok": True})
                    break
                if cmd == "info":
                    res = {"transfer_addr": engine.address, "zmq_addr": channel.address}
                elif cmd == "sender":
                    objs[c["room"]] = mgr.create_sender(c["room"])
                    res = state(c["room"])
                elif cmd == "send":
                    objs[c["room"]].send(c["pages"], prompt_len=c.get("prompt_len", 0),
                                         first_token=c.get("first_token"))
                    res = state(c["room"])
                elif cmd == "receiver":
                    r = mgr.create_receiver(c["room"], c["p"])
                    objs[c["room"]] = r
                    if c.get("pages") is not None:
                        r.init(c["pages"])
                    res = state(c["room"])
                elif cmd == "init":
                    objs[c["room"]].init(c["pages"])
                    res = state(c["room"])
                elif cmd == "state":
                    o = objs.get(c["room"])
                    res = state(c["room"])
                    if o is not None and getattr(o, "ready_info", None) is not None:
                        res["first_token"] = o.ready_info.first_token
                        res["prompt_len"] = o.ready_info.prompt_len
                    if o is not None and hasattr(o, "pulled_bytes"):
                        res["pulled_bytes"] = o.pulled_bytes
                elif cmd == "wait":
                    waiters.append((c["room"], now + c["wait_s"], now, cid))
                    continue
                elif cmd == "stats":
                    res = {"registered": mgr.num_registered(), "active": mgr.num_active(),
                           "connections": engine.num_connections(),
                           "held_bytes": engine.registered_bytes(),
                           "held_device_bytes": engine.registered_device_bytes(),
                           "channel": channel.stats()}
                elif cmd == "dump":
                    arr = np.stack([np.asarray(kv)[c["pages"]] for kv in runner.kv_caches])
                    buf = io.BytesIO()
                    np.save(buf, arr)
                    res = {"npy": base64.b64encode(buf.getvalue()).decode()}
                elif cmd == "register_raw":  # benchmark: chunks of chunk_mb filling mb
                    n = max(1, round(c["mb"] / c["chunk_mb"]))
                    elems = int(c["chunk_mb"] * (1 << 20)) // 4
                    arrays = [jax.device_put(np.full((elems,), i, np.float32), jax.devices()[0])
                              for i in range(n)]
                    jax.block_until_ready(arrays)
                    uid, _ = engine.register(c["room"], arrays, 600)
                    raw_regs[c["room"]] = arrays
                    res = {"uuid": uid, "n": n, "elems": elems}
                elif cmd == "release":
                    res = {"released": engine.release(c["room"])}
                else:
                    res = {"error": f"unknown command {cmd!r}"}
            except Exception as e:  # report, keep serving
                res = {"error": f"{type(e).__name__}: {e}"}
            _out({"id": cid, **res})
    finally:
        mgr.close()


if __name__ == "__main__":
    main()
