"""A GGUF file converted once into a cached Hugging Face directory, which the loader then streams.

`converted_dir(gguf_path, cache_dir)` returns `<cache_dir>/gguf/<stem>-<key>/`, where the key
hashes the file's resolved path, size and modification time with `CONVERTER_VERSION`; a
directory already there (complete: `source.json` is written last) is reused, so only the first
start pays for the conversion. Converting: refuse what pdtopo cannot serve
(`gguf_config.gguf_refusals`, before anything is written), write config.json and
generation_config.json (metadata), tokenizer.json and tokenizer_config.json (vocabulary, merges,
chat template), then the weights dequantized to float32, one safetensors file per layer (plus
one for the embeddings, final norm and output) with model.safetensors.index.json, so memory holds
one layer at a time; progress goes to the log (`converting NAME.gguf: layer x/y`). The work
happens in a temporary directory renamed into place, under a file lock, so processes starting
together convert once and never see half a directory (what a killed conversion left is removed
by the next). The float32 copy takes 4 bytes per parameter: 4-8x the size of a quantized file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from pdtopo.model_config.sources.gguf_config import architecture, gguf_refusals, hf_config
from pdtopo.model_config.sources.gguf_reading import GgufFile
from pdtopo.model_config.sources.gguf_tokenizer import gguf_tokenizer, gguf_tokenizer_config
from pdtopo.model_config.sources.gguf_weights import hf_tensors, layer_of

log = logging.getLogger(__name__)

CONVERTER_VERSION = 2  # bump when the conversion's output changes: caches convert again
SOURCE_FILE = "source.json"
INDEX_FILE = "model.safetensors.index.json"


def _key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def cache_path(gguf_path: str | Path, cache_dir: str | Path) -> Path:
    path = Path(gguf_path)
    return Path(cache_dir).expanduser() / "gguf" / f"{path.stem}-{_key(path)}"


@contextmanager
def _locked(lock_file: Path):
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"model.cache_dir: cannot create {lock_file.parent}: {e}") from e
    with open(lock_file, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _shard_name(group: int, groups: int) -> str:
    return f"model-{group + 1:05d}-of-{groups:05d}.safetensors"


def _write_weights(file: GgufFile, arch: str, out: Path, num_layers: int) -> None:
    """One safetensors file per layer, then one for the rest; the index maps names to files."""
    by_group: dict[int, list[str]] = {}
    for name in file.tensors:
        layer = layer_of(name)
        by_group.setdefault(num_layers if layer is None else layer, []).append(name)
    groups = sorted(by_group)
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()
    for n, group in enumerate(groups):
        shard = _shard_name(n, len(groups))
        tensors = dict(hf_tensors(file, arch, by_group[group]))
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        if group < num_layers and ((group + 1) % max(1, num_layers // 5) == 0
                                   or group + 1 == num_layers):
            log.info("converting %s: layer %d/%d (%.1fs)", file.path.name, group + 1,
                     num_layers, time.perf_counter() - t0)
    total = sum(int(os.path.getsize(out / f)) for f in set(weight_map.values()))
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def convert(gguf_path: str | Path, out: Path) -> None:
    """Write the HF directory for `gguf_path` into `out` (an empty directory)."""
    t0 = time.perf_counter()
    file = GgufFile(gguf_path)
    problems = gguf_refusals(file)
    if problems:
        raise problems[0]
    arch = architecture(file)
    config = hf_config(file)
    tokenizer, tok_config = gguf_tokenizer(file), gguf_tokenizer_config(file)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_weights(file, arch, out, int(config["num_hidden_layers"]))
    st = Path(gguf_path).stat()
    _write_json(out / SOURCE_FILE, {"gguf": str(Path(gguf_path).resolve()), "size": st.st_size,
                                    "mtime_ns": st.st_mtime_ns,
                                    "converter_version": CONVERTER_VERSION,
                                    "general.name": file.metadata.get("general.name")})
    log.info("converted %s in %.1fs", Path(gguf_path).name, time.perf_counter() - t0)


def converted_dir(gguf_path: str | Path, cache_dir: str | Path) -> Path:
    """The cached HF directory of `gguf_path`, converting it first if it is not there."""
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"model.path={str(gguf_path)!r}: no such GGUF file")
    target = cache_path(path, cache_dir)
    if (target / SOURCE_FILE).is_file():
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if (target / SOURCE_FILE).is_file():  # another process converted it meanwhile
            return target
        for stale in target.parent.glob(f"{target.name}.tmp-*"):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        log.info("converting %s (once) into %s", path.name, target)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            convert(path, tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
