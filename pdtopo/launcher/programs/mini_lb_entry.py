"""The proxy program of `proxy.kind=mini_lb`: sglang-router's MiniLB with pdtopo's body limit.

    python -m pdtopo.launcher.programs.mini_lb_entry --mini-lb <launch_router arguments>
                                            --max-payload-size N

MiniLB (`sglang_router.mini_lb`: a FastAPI app served by uvicorn) takes the router's
`--max-payload-size` but enforces nothing: it reads a body of any size whole and forwards it to
P and D. This entry parses the arguments with the router's own parser, wraps MiniLB's app in
`pdtopo.body_limit.BodyLimitMiddleware` with that size (the plan writes it from
`server.max_body_bytes`, the limit of every server too), and starts MiniLB unmodified: a body
over the limit is answered 413 before the rest of it is read, never forwarded.
"""

from __future__ import annotations

import sys

from sglang_router import mini_lb
from sglang_router.launch_router import launch_router, parse_router_args

from pdtopo.body_limit import BodyLimitMiddleware

LIMIT_KEY = "server.max_body_bytes"  # where the plan takes --max-payload-size from


def main(argv: list[str] | None = None) -> None:
    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    if not args.mini_lb:
        raise SystemExit("mini_lb_entry: runs MiniLB only (--mini-lb)")
    mini_lb.app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_payload_size,
                               key=LIMIT_KEY)
    launch_router(args)


if __name__ == "__main__":
    main()
