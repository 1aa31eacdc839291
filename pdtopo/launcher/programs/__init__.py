"""What supervisord runs with `python -m`: the CPU pinning wrapper, the router entry points
(API key from the environment, MiniLB with a body limit), the TCP_NODELAY wrapper and its C
shim, and the router watch event listener. May import operate/, render/ and plan/."""
