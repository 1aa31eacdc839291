"""KV page gather/scatter kernels (Pallas TPU multi_layer_copy and an XLA implementation)."""
