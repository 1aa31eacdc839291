"""Llama-family model in JAX, weight loading and tokenizers."""
