"""The bootstrap server and its clients: where P and D instances find each other.

protocol.py (registration messages, shared by both sides) -> registry.py (the server's table
of live registrations, TTL-expired) -> server.py (the FastAPI app and the process entry:
`python -m pdtopo.runtime.bootstrap`) ; client.py (what P and D use: register, heartbeat,
look up peers). The wire format is in docs/protocol.md.
"""
