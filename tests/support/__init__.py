"""What the tests share: constants (paths, the tiny model's overrides, greedy sampling), an
ASGI app served in a thread, and the helpers of the process tests (deployments, servers, KV
peers, faults, goldens, CI tool checks). Test modules live in tests/unit and tests/e2e."""
