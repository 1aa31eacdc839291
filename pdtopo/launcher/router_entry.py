"""The proxy program when the deployment has an API key: sglang-router (or, with
`--router-module smg.launch_router`, the model gateway of `proxy.kind=gateway`), with the key
kept off the command line (anyone on the host can read a process's argv; its environment only
the owner).

    python -m pdtopo.launcher.router_entry [--router-module MODULE] <launch_router arguments>

The key comes from `PDTOPO_PROXY_API_KEY` (put into the program's environment by the
launcher from `proxy.api_key`, in supervisord.conf with mode 0600) or from the first line of the
file named by `PDTOPO_PROXY_API_KEY_FILE` (`proxy.api_key_file`). The arguments are parsed by
the router's own parser (both packages offer `parse_router_args` and `launch_router`), the key
is set on the parsed `RouterArgs`, and the router is started in this process, unmodified.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

API_KEY_ENV = "PDTOPO_PROXY_API_KEY"
API_KEY_FILE_ENV = "PDTOPO_PROXY_API_KEY_FILE"
DEFAULT_ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_MODULES = (DEFAULT_ROUTER_MODULE, "smg.launch_router")


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


def split_router_module(argv: list[str]) -> tuple[str, list[str]]:
    """(router module, the router's own arguments) from this program's arguments."""
    if argv[:1] != ["--router-module"]:
        return DEFAULT_ROUTER_MODULE, argv
    if len(argv) < 2 or argv[1] not in ROUTER_MODULES:
        raise SystemExit(f"router_entry: --router-module takes one of {', '.join(ROUTER_MODULES)}"
                         f", got {argv[1] if len(argv) > 1 else 'nothing'}")
    return argv[1], argv[2:]


def main(argv: list[str] | None = None) -> None:
    module_name, router_argv = split_router_module(sys.argv[1:] if argv is None else argv)
    router = importlib.import_module(module_name)
    args = router.parse_router_args(router_argv)
    args.api_key = read_api_key()
    router.launch_router(args)


if __name__ == "__main__":
    main()
