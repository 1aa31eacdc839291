"""Streamed, sharded loading: a checkpoint of a few hundred MB loads with host memory bounded by
what the devices keep plus about one tensor (traced with tracemalloc, which sees NumPy's
allocations; the CPU backend may keep a host array as a device buffer), at tp=1 and tp=4;
every device's shard equals the checkpoint's tensor (transposed, KV heads repeated where tp asks
for it); bfloat16 and float16 checkpoints load."""

from __future__ import annotations

import gc
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from pdtopo.model_config.random_checkpoint import CheckpointShape, write_random_checkpoint
from pdtopo.model_config.safetensors_view import SafetensorsFile
from pdtopo.model_config.spec import model_config_from_cfg
from pdtopo.runtime.engine.mesh import build_mesh
from pdtopo.runtime.model import llama
from pdtopo.runtime.model.loader import load_params

# 12 layers of hidden 512, untied 8192-vocab head: 55.6 M float32 parameters (222 MB); 8 heads
# and 4 KV heads split over tp=4
BIG = CheckpointShape(vocab=8192, hidden=512, ffn=2048, layers=12, heads=8, kv_heads=4,
                      rope_theta=10000.0)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    tensors = write_random_checkpoint(root, "llama", shape=BIG)
    total = sum(a.nbytes for a in tensors.values())
    largest = max(a.nbytes for a in tensors.values())
    probe = {n: tensors[n] for n in ("model.layers.3.self_attn.k_proj.weight",
                                     "model.layers.3.mlp.down_proj.weight",
                                     "lm_head.weight")}
    del tensors
    gc.collect()
    return root, total, largest, probe


@pytest.mark.parametrize("tp", [1, 4])
def test_load_peak_host_memory_is_about_one_tensor(big_checkpoint, tp):
    root, total, largest, probe = big_checkpoint
    assert total > 200e6
    cfg = model_config_from_cfg({"path": str(root)})
    mesh = build_mesh(tp)
    gc.collect()
    tracemalloc.start()
    try:
        params = load_params(cfg, mesh, np.float32)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"tp={tp}: checkpoint {total / 1e6:.0f} MB, largest tensor {largest / 1e6:.1f} MB, "
          f"peak traced host memory during the load {peak / 1e6:.1f} MB, kept after it "
          f"{kept / 1e6:.1f} MB (CPU device buffers that alias host arrays)")
    # what the devices keep, plus about one tensor's blocks in flight (and its cast); the
    # whole-model loader this replaces peaked above the checkpoint's size
    assert peak <= kept + 2 * largest + 16e6, (peak, kept, largest)
    assert peak < total / 2, (peak, total)
    layer = params["layers"][3]
    for ours, name, transpose in ((layer["wk"], "model.layers.3.self_attn.k_proj.weight", True),
                                  (layer["w_down"], "model.layers.3.mlp.down_proj.weight", True),
                                  (params["lm_head"], "lm_head.weight", True)):
        want = probe[name].T if transpose else probe[name]
        assert len(ours.addressable_shards) == tp
        for shard in ours.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_repeated_kv_heads_load_by_index(tmp_path):
    """tp=4 over 2 KV heads: each KV head is read into two devices' columns."""
    root = tmp_path / "gqa"
    shape = CheckpointShape(vocab=320, hidden=64, ffn=96, layers=2, heads=8, kv_heads=2,
                            rope_theta=500.0)
    tensors = write_random_checkpoint(root, "qwen2", shape=shape)
    cfg = model_config_from_cfg({"path": str(root)})
    params = load_params(cfg, build_mesh(4), np.float32)
    assert llama.kv_replication(cfg, 4) == 2
    for key, name in (("wk", "k_proj.weight"), ("bv", "v_proj.bias")):
        host = {"layers": [{key: tensors[f"model.layers.{i}.self_attn.{name}"].T}
                           for i in range(2)]}
        want = llama.replicate_kv_heads(host, cfg, 2)["layers"][1][key]
        np.testing.assert_array_equal(np.asarray(params["layers"][1][key]), want)


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load_and_cast_per_block(tmp_path, stored):
    root = tmp_path / stored
    tensors = write_random_checkpoint(root, "llama")
    dtype = np.dtype(ml_dtypes.bfloat16) if stored == "bfloat16" else np.dtype(np.float16)
    for file in root.glob("*.safetensors"):
        names = SafetensorsFile(file).names()
        save_file({n: tensors[n].astype(dtype) for n in names}, str(file))
    cfg = model_config_from_cfg({"path": str(root)})
    name = "model.layers.1.self_attn.q_proj.weight"
    file = next(f for f in root.glob("*.safetensors") if name in SafetensorsFile(f).names())
    assert SafetensorsFile(file).dtype(name) == dtype
    for target in (np.float32, ml_dtypes.bfloat16):
        params = load_params(cfg, build_mesh(2), target)
        got = np.asarray(params["layers"][1]["wq"])
        assert got.dtype == np.dtype(target)
        want = tensors[name].astype(dtype).astype(np.float32).T
        np.testing.assert_array_equal(got.astype(np.float32),
                                      want.astype(target).astype(np.float32))
