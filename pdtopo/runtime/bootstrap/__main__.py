"""`python -m pdtopo.runtime.bootstrap ...`: the bootstrap server's process entry."""

from pdtopo.runtime.bootstrap.server import main

main()
