"""KV data-plane benchmark: transfer pull vs raw TCP, scatter (XLA) vs NumPy memcpy.

    python benchmarks/bench_transfer.py [--sizes-mb 1 16 64 256] [--chunk-mb 4] [--reps 5]
        [--sockets 4] [--transfer-size-mb 1] [--raw-buffers auto|true|false] [--hetero]

One run measures, on this machine, with baselines taken in the same run:
  1. pull throughput of JaxTransferKVEngine (a P process started here registers packed arrays of
     `chunk_mb` each; this process pulls them and waits until ready), per
     total size; the engine's defaults are the project's (disaggregation.* in conf/config.yaml);
  2. raw loopback TCP (sendall / recv_into of the same bytes between the same two processes);
  3. their ratio (goal >= 0.8x at >= 16 MB);
  4. scatter throughput of pdtopo.kernels.insert_kv_chunks (XLA impl) vs NumPy fancy-index
     assignment of the same pages (goal >= 0.5x).
Medians over `reps` after one warm-up per size. The peer is this file with --serve.

--hetero measures only the reshard instead: a tp=1 D (this process) takes the same KV bytes from
a tp=1 P (registered as is, scattered as is: the baseline) and from a tp=2 P (one piece per P
shard, written into head ranges of the pool: `pdtopo.runtime.disagg.reshard.arrays`,
`pdtopo.runtime.disagg.transport.resharding.scatter_pieces`), interleaved, timed from the
pull's start until the pages are in D's pool; goal >= 0.8x of the baseline. The peers are this file with --serve-kv TP.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


# ----------------------------------------------------------------------------- peer (P) side
def serve(sockets: int, transfer_size_mb: float, raw_buffers: str) -> None:
    import jax

    from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine

    engine = JaxTransferKVEngine(transfer_sockets=sockets, transfer_size_mb=transfer_size_mb,
                                 raw_buffers=_flag(raw_buffers))
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    payload = np.ones(1 << 28, np.uint8)  # 256 MB raw source buffer

    def raw_server() -> None:
        while True:
            conn, _ = lsock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                while True:
                    hdr = conn.recv(16)
                    if not hdr:
                        break
                    n = int(hdr.decode().strip())
                    view = memoryview(payload)
                    sent = 0
                    while sent < n:
                        k = min(n - sent, len(payload))
                        conn.sendall(view[:k])
                        sent += k

    threading.Thread(target=raw_server, daemon=True).start()
    print(json.dumps({"addr": engine.address, "raw_port": lsock.getsockname()[1]}), flush=True)
    room = 0
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "quit":
            break
        n, elems = c["n"], c["elems"]
        arrays = [jax.device_put(np.full((elems,), i, np.float32)) for i in range(n)]
        jax.block_until_ready(arrays)
        room += 1
        uuid, _ = engine.register(room, arrays, 120)
        print(json.dumps({"uuid": uuid, "room": room}), flush=True)
        engine.release(room)  # the server keeps its own reference until pulled
    engine.close()


# ----------------------------------------------------------------------------- D side
def bench_pull(sizes_mb, chunk_mb, reps, sockets, transfer_size_mb, raw_buffers) -> list[dict]:
    import jax

    from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    peer = subprocess.Popen([sys.executable, __file__, "--serve", "--sockets", str(sockets),
                             "--transfer-size-mb", str(transfer_size_mb),
                             "--raw-buffers", raw_buffers],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        hello = json.loads(peer.stdout.readline())
        engine = JaxTransferKVEngine(transfer_sockets=sockets, transfer_size_mb=transfer_size_mb,
                                     raw_buffers=_flag(raw_buffers))
        raw = socket.create_connection(("127.0.0.1", hello["raw_port"]))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sink = np.empty(int(max(sizes_mb) * (1 << 20)) + (1 << 20), np.uint8)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        rows = []
        for mb in sizes_mb:
            cmb = min(chunk_mb, mb)
            n = max(1, round(mb / cmb))
            elems = int(cmb * (1 << 20)) // 4
            nbytes = n * elems * 4
            specs = [jax.ShapeDtypeStruct((elems,), np.float32, sharding=dev)] * n

            def one_pull(specs=specs, n=n, elems=elems) -> float:
                peer.stdin.write(json.dumps({"cmd": "reg", "n": n, "elems": elems}) + "\n")
                peer.stdin.flush()
                uuid = json.loads(peer.stdout.readline())["uuid"]
                t0 = time.perf_counter()
                got = engine.pull(hello["addr"], uuid, specs, 120, room=uuid).result()
                dt = time.perf_counter() - t0
                assert float(got[-1][0]) == n - 1, "pulled data is wrong"
                return dt

            def one_raw(nbytes=nbytes) -> float:
                view = memoryview(sink)[:nbytes]
                t0 = time.perf_counter()
                raw.sendall(f"{nbytes:<16d}".encode())
                got = 0
                while got < nbytes:
                    got += raw.recv_into(view[got:], nbytes - got)
                return time.perf_counter() - t0

            one_pull()
            one_raw()
            tp = statistics.median(one_pull() for _ in range(reps))
            tr = statistics.median(one_raw() for _ in range(reps))
            rows.append({"mb": nbytes / (1 << 20), "arrays": n, "pull_gbs": nbytes / tp / 1e9,
                         "raw_gbs": nbytes / tr / 1e9, "ratio": tr / tp})
        raw.close()
        engine.close()
        return rows
    finally:
        _stop_peer(peer)


def _stop_peer(peer: subprocess.Popen) -> None:
    """Ask a --serve / --serve-kv peer to quit; kill it if it does not."""
    try:
        peer.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        peer.stdin.flush()
        peer.wait(timeout=20)
    except Exception:
        pass
    if peer.poll() is None:
        peer.kill()
        peer.wait()


# ----------------------------------------------------------------------------- --hetero
HETERO_PAGE, HETERO_HEADS, HETERO_HEAD_DIM, HETERO_ENTRIES = 16, 8, 128, 8  # 512 KB a page


def serve_kv(tp: int, sockets: int, transfer_size_mb: float, raw_buffers: str) -> None:
    """P for --hetero: packed KV [n, page, heads, head_dim] x entries sharded over `tp`
    devices, registered as is for a D laid out alike, else cut into that D's pieces."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pdtopo.runtime.disagg.reshard.arrays import register_parts
    from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, plan_pieces, same_layout
    from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine

    engine = JaxTransferKVEngine(transfer_sockets=sockets, transfer_size_mb=transfer_size_mb,
                                 raw_buffers=_flag(raw_buffers))
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:tp]), ("tp",)),
                             PartitionSpec(None, None, "tp", None))
    mine = KVShardLayout(HETERO_HEADS, HETERO_HEADS, tp, (0,) * tp)
    print(json.dumps({"addr": engine.address}), flush=True)
    room = 0
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "quit":
            break
        shape = (c["pages"], HETERO_PAGE, HETERO_HEADS, HETERO_HEAD_DIM)
        packed = [jax.device_put(np.full(shape, e, np.float32), sharding)
                  for e in range(HETERO_ENTRIES)]
        jax.block_until_ready(packed)
        d = KVShardLayout(HETERO_HEADS, HETERO_HEADS, c["d_tp"], (0,) * c["d_tp"])
        room += 1
        uuid = engine.new_uuid()
        if same_layout(mine, d):
            engine.register(room, packed, 120, uuid=uuid)
        else:
            register_parts(engine, room, packed, mine, plan_pieces(mine, d), 0, uuid, 120)
        print(json.dumps({"uuid": uuid}), flush=True)
        engine.release(room)  # the server keeps its own reference until pulled
    engine.close()


def bench_hetero(sizes_mb, reps, sockets, transfer_size_mb, raw_buffers) -> list[dict]:
    """D (tp=1, this process) takes the same KV bytes from a tp=1 P (pulled as is, scattered
    with insert_kv_chunks) and from a tp=2 P (one piece per P shard, written straight into
    head ranges of the pool by scatter_pieces), interleaved; timed from the pull's start
    until the pages are in D's pool."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pdtopo.kernels import insert_kv_chunks
    from pdtopo.runtime.disagg.reshard.arrays import piece_specs, pull_parts
    from pdtopo.runtime.disagg.reshard.layout import KVShardLayout, plan_pieces
    from pdtopo.runtime.disagg.transport.base import PoolTransferSpec
    from pdtopo.runtime.disagg.transport.resharding import scatter_pieces
    from pdtopo.runtime.disagg.transport.transfer_engine import JaxTransferKVEngine

    peers = {}
    for tp in (1, 2):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={tp}")
        peers[tp] = subprocess.Popen(
            [sys.executable, __file__, "--serve-kv", str(tp), "--sockets", str(sockets),
             "--transfer-size-mb", str(transfer_size_mb), "--raw-buffers", raw_buffers],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        addrs = {tp: json.loads(p.stdout.readline())["addr"] for tp, p in peers.items()}
        engine = JaxTransferKVEngine(transfer_sockets=sockets, transfer_size_mb=transfer_size_mb,
                                     raw_buffers=_flag(raw_buffers))
        sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("tp",)),
                                 PartitionSpec(None, None, "tp", None))
        d_layout = KVShardLayout(HETERO_HEADS, HETERO_HEADS, 1, (0,))
        p_layout = KVShardLayout(HETERO_HEADS, HETERO_HEADS, 2, (0, 0))
        pieces = plan_pieces(p_layout, d_layout)
        page_bytes = HETERO_PAGE * HETERO_HEADS * HETERO_HEAD_DIM * 4 * HETERO_ENTRIES
        most = max(1, round(max(sizes_mb) * (1 << 20) / page_bytes))
        pool_shape = (most + 1, HETERO_PAGE, HETERO_HEADS, HETERO_HEAD_DIM)
        state = {"pool": [jax.device_put(np.zeros(pool_shape, np.float32), sharding)
                          for _ in range(HETERO_ENTRIES)]}
        spec = PoolTransferSpec.from_kv_caches(state["pool"])

        def scatter(kv, packed, ids, first_row=0):
            return insert_kv_chunks(kv, packed, ids, impl="xla", first_row=first_row)

        rows = []
        for mb in sizes_mb:
            n = max(1, round(mb * (1 << 20) / page_bytes))
            nbytes = n * page_bytes
            pages = list(range(1, n + 1))

            def register(tp: int, n: int = n) -> int:
                peers[tp].stdin.write(json.dumps({"cmd": "reg", "pages": n, "d_tp": 1}) + "\n")
                peers[tp].stdin.flush()
                return json.loads(peers[tp].stdout.readline())["uuid"]

            def homo(n: int = n, pages: list[int] = pages) -> float:
                uuid = register(1)
                specs = [jax.ShapeDtypeStruct((n, HETERO_PAGE, HETERO_HEADS, HETERO_HEAD_DIM),
                                              np.float32, sharding=sharding)] * HETERO_ENTRIES
                t0 = time.perf_counter()
                got = engine.pull(addrs[1], uuid, specs, 120, room=uuid).result()
                state["pool"] = scatter(state["pool"], got, pages)
                jax.block_until_ready(state["pool"])
                dt = time.perf_counter() - t0
                assert float(state["pool"][-1][n, 0, -1, 0]) == HETERO_ENTRIES - 1, "wrong data"
                return dt

            def hetero(n: int = n, pages: list[int] = pages) -> float:
                uuid = register(2)

                def specs_of(group):
                    return piece_specs(n, HETERO_PAGE, HETERO_HEAD_DIM, np.float32,
                                       HETERO_ENTRIES, group, sharding, d_layout)

                t0 = time.perf_counter()
                got = pull_parts(engine, uuid, [addrs[2]], uuid, pieces, 0, HETERO_ENTRIES,
                                 specs_of, 120).result()
                state["pool"] = scatter_pieces(state["pool"], got, list(pieces), pieces,
                                               d_layout, spec, pages, 0, scatter)
                jax.block_until_ready(state["pool"])
                dt = time.perf_counter() - t0
                assert float(state["pool"][-1][n, 0, -1, 0]) == HETERO_ENTRIES - 1, "wrong data"
                return dt

            for _ in range(2):  # warm-up: compiles, connections
                state["pool"] = [jax.device_put(np.zeros(pool_shape, np.float32), sharding)
                                 for _ in range(HETERO_ENTRIES)]
                homo()
                state["pool"] = [jax.device_put(np.zeros(pool_shape, np.float32), sharding)
                                 for _ in range(HETERO_ENTRIES)]
                hetero()
            th, tx = [], []
            for _ in range(reps):  # interleaved: both see the same machine state
                th.append(homo())
                tx.append(hetero())
            h, x = statistics.median(th), statistics.median(tx)
            rows.append({"mb": nbytes / (1 << 20), "pages": n, "homo_gbs": nbytes / h / 1e9,
                         "hetero_gbs": nbytes / x / 1e9, "ratio": h / x})
        engine.close()
        return rows
    finally:
        for p in peers.values():
            _stop_peer(p)


def _flag(value: str) -> str | bool:
    return value if value == "auto" else value == "true"


def bench_scatter(reps: int) -> dict:
    import jax

    from pdtopo.kernels import insert_kv_chunks

    entries, num_pages, page_size, heads, head_dim = 8, 512, 16, 8, 128
    n = 256
    shape = (num_pages, page_size, heads, head_dim)
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(np.arange(1, num_pages), n, replace=False))
    rng.shuffle(ids)
    packed_np = [rng.standard_normal((n, *shape[1:]), dtype=np.float32) for _ in range(entries)]
    packed = [jax.device_put(p) for p in packed_np]
    nbytes = sum(p.nbytes for p in packed_np)
    pool = [jax.device_put(np.zeros(shape, np.float32)) for _ in range(entries)]
    pool = insert_kv_chunks(pool, packed, ids, impl="xla")  # warm-up / compile
    jax.block_until_ready(pool)
    tx = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pool = insert_kv_chunks(pool, packed, ids, impl="xla")
        jax.block_until_ready(pool)
        tx.append(time.perf_counter() - t0)
    check = np.asarray(pool[3])[ids]
    assert np.array_equal(check, packed_np[3]), "scatter wrote wrong data"
    pool_np = [np.zeros(shape, np.float32) for _ in range(entries)]
    tn = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for dst, src in zip(pool_np, packed_np, strict=True):
            dst[ids] = src
        tn.append(time.perf_counter() - t0)
    tx_m, tn_m = statistics.median(tx), statistics.median(tn[1:])
    return {"mb": nbytes / (1 << 20), "pages": n, "entries": entries,
            "xla_gbs": nbytes / tx_m / 1e9, "numpy_gbs": nbytes / tn_m / 1e9,
            "ratio": tn_m / tx_m}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--chunk-mb", type=float, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sockets", type=int, default=4, help="transfer_sockets")
    ap.add_argument("--transfer-size-mb", type=float, default=1, help="transfer_size_mb")
    ap.add_argument("--raw-buffers", choices=("auto", "true", "false"), default="auto",
                    help="transfer_raw_buffers")
    ap.add_argument("--hetero", action="store_true",
                    help="only the reshard comparison: pull from a tp=2 P into a tp=1 D vs "
                         "tp=1 -> tp=1, the same KV bytes")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-kv", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.serve:
        serve(args.sockets, args.transfer_size_mb, args.raw_buffers)
        return
    if args.serve_kv:
        serve_kv(args.serve_kv, args.sockets, args.transfer_size_mb, args.raw_buffers)
        return
    if args.hetero:
        print(f"KV pull + scatter into a tp=1 D's pool: from a tp=2 P (resharded: one piece per "
              f"P shard, written into head ranges) vs from a tp=1 P (baseline, as is); "
              f"{HETERO_ENTRIES} entries of "
              f"{HETERO_HEADS} heads x {HETERO_HEAD_DIM}, pages of {HETERO_PAGE}; median of "
              f"{args.reps}, interleaved")
        print(f"{'size MB':>8} {'pages':>6} {'tp1->tp1 GB/s':>14} {'tp2->tp1 GB/s':>14} "
              f"{'ratio':>6}  goal")
        for r in bench_hetero(args.sizes_mb, args.reps, args.sockets, args.transfer_size_mb,
                              args.raw_buffers):
            print(f"{r['mb']:8.0f} {r['pages']:6d} {r['homo_gbs']:14.2f} "
                  f"{r['hetero_gbs']:14.2f} {r['ratio']:6.2f}  >=0.8")
        return
    print(f"KV pull (jax.experimental.transfer, {args.sockets} transport sockets, "
          f"{args.chunk_mb:g} MB arrays, transfer_size {args.transfer_size_mb:g} MB, raw buffers "
          f"{args.raw_buffers}) vs raw loopback TCP; median of {args.reps}")
    print(f"{'size MB':>8} {'arrays':>6} {'pull GB/s':>10} {'raw TCP GB/s':>13} {'ratio':>6}  goal")
    for r in bench_pull(args.sizes_mb, args.chunk_mb, args.reps, args.sockets,
                         args.transfer_size_mb, args.raw_buffers):
        goal = ">=0.8" if r["mb"] >= 16 else "-"
        print(f"{r['mb']:8.0f} {r['arrays']:6d} {r['pull_gbs']:10.2f} {r['raw_gbs']:13.2f} "
              f"{r['ratio']:6.2f}  {goal}")
    s = bench_scatter(args.reps)
    print(f"\nscatter {s['pages']} pages x {s['entries']} entries ({s['mb']:.0f} MB): "
          f"insert_kv_chunks XLA {s['xla_gbs']:.2f} GB/s, NumPy memcpy {s['numpy_gbs']:.2f} GB/s, "
          f"ratio {s['ratio']:.2f} (goal >= 0.5)")


if __name__ == "__main__":
    main()
