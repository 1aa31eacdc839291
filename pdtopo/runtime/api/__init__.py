"""HTTP API of a pdtopo server (sglang-compatible native API + OpenAI-compatible routes)."""
