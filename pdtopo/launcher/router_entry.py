"""The proxy program when the deployment has an API key: sglang-router, with the key kept off
the command line (anyone on the host can read a process's argv; its environment only the
owner).

    python -m pdtopo.launcher.router_entry <sglang_router.launch_router arguments>

The key comes from `PDTOPO_PROXY_API_KEY` (put into the program's environment by the
launcher from `proxy.api_key`, in supervisord.conf with mode 0600) or from the first line of the
file named by `PDTOPO_PROXY_API_KEY_FILE` (`proxy.api_key_file`). The arguments are parsed by
sglang-router's own parser, the key is set on the parsed `RouterArgs`, and the router is
started in this process, unmodified.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sglang_router.launch_router import launch_router, parse_router_args

API_KEY_ENV = "PDTOPO_PROXY_API_KEY"
API_KEY_FILE_ENV = "PDTOPO_PROXY_API_KEY_FILE"


def read_api_key(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """The key from the environment or the key file; SystemExit naming what is wrong."""
    key = environ.get(API_KEY_ENV)
    path = environ.get(API_KEY_FILE_ENV)
    if key:
        return key
    if not path:
        raise SystemExit(f"router_entry: set {API_KEY_ENV} or {API_KEY_FILE_ENV} "
                         "(proxy.api_key / proxy.api_key_file)")
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"router_entry: proxy.api_key_file={path!r}: cannot read it "
                         f"({exc.strerror or exc})") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise SystemExit(f"router_entry: proxy.api_key_file={path!r} is empty")
    return key


def main(argv: list[str] | None = None) -> None:
    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    args.api_key = read_api_key()
    launch_router(args)


if __name__ == "__main__":
    main()
