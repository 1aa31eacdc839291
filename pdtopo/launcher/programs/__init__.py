"""What supervisord runs with `python -m`: the CPU pinning wrapper, the router entry points
(API key from the environment, MiniLB with a body limit), the TCP_NODELAY wrapper and its C
shim, the router watch event listener and the live P/D planner. May import operate/, render/
and plan/."""
