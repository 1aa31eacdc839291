"""Client side of the bootstrap server: lookups, and a thread that keeps a rank registered.

`BootstrapClient` wraps the HTTP endpoints (with the deployment token). `RegistrationKeeper`
registers one rank at start (retrying until the bootstrap server answers), heartbeats every
`interval_s`, and registers again whenever a heartbeat answers 404 — which is what happens after
the bootstrap server restarts or the entry expired. `find_prefill(host, zmq_port)` resolves the
`(bootstrap_host, bootstrap_port)` pair that the router injects into a request to the prefill
instance's registration (the router's bootstrap port is the P instance's side-channel port).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import httpx

from pdtopo.runtime.bootstrap.protocol import Heartbeat, Registration
from pdtopo.runtime.worker_threads import (
    NO_FAULT,
    CrashHandler,
    FaultInjector,
    WorkerThread,
    crash_process,
)

log = logging.getLogger("pdtopo.bootstrap_client")


class BootstrapError(RuntimeError):
    """The bootstrap server refused a call or could not be reached."""


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


class BootstrapClient:
    def __init__(self, url: str, token: str | None, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise BootstrapError(f"bootstrap server {self.url} unreachable: {exc}") from exc

    @staticmethod
    def _ok(resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise BootstrapError(f"bootstrap {resp.request.url.path} -> {resp.status_code}: {detail}")
        return resp.json()

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def register(self, reg: Registration) -> dict:
        return self._ok(self._call("PUT", "/route", json=reg.model_dump()))

    def heartbeat(self, hb: Heartbeat) -> bool:
        """True if refreshed, False if the server does not know this rank (register again)."""
        resp = self._call("POST", "/heartbeat", json=hb.model_dump())
        if resp.status_code == 404:
            return False
        self._ok(resp)
        return True

    def list(self, role: str | None = None) -> list[dict]:
        return self._ok(self._call("GET", "/list", params={"role": role} if role else None))

    def route(self, role: str, instance_id: str, ranks: dict[str, int] | None = None) -> dict:
        params = {"role": role, "instance_id": instance_id, **(ranks or {})}
        return self._ok(self._call("GET", "/route", params=params))

    def find_prefill(self, host: str, zmq_port: int) -> dict:
        """The registration of the prefill rank whose side channel is host:zmq_port."""
        entries = self.list("prefill")
        for entry in entries:
            e_host, _, e_port = entry["zmq_addr"].rpartition(":")
            if int(e_port) == int(zmq_port) and _same_host(e_host, host):
                return entry
        known = ", ".join(e["zmq_addr"] for e in entries) or "none"
        raise BootstrapError(
            f"no live prefill instance with side channel {host}:{zmq_port} "
            f"(registered: {known})"
        )


class RegistrationKeeper:
    """Keeps one rank registered: register, heartbeat, re-register after 404 or outage."""

    def __init__(self, client: BootstrapClient, reg: Registration, interval_s: float = 5.0, *,
                 on_crash: CrashHandler = crash_process, fault: FaultInjector = NO_FAULT):
        """`on_crash(name, exc)`: the thread died (default: end the process, which would
        otherwise drop out of the registry while /health stays 200); `fault` kills it on
        purpose at its N-th heartbeat (testing: server.fault_inject_thread=bootstrap_keeper)."""
        self.client = client
        self.reg = reg
        self.interval_s = interval_s
        self.registrations = 0  # how many times PUT /route succeeded (tests read it)
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._fault = fault
        self._thread = WorkerThread("bootstrap-keeper", self._run, on_crash)
        self._hb = Heartbeat(
            role=reg.role, instance_id=reg.instance_id, tp_rank=reg.tp_rank,
            cp_rank=reg.cp_rank, dp_rank=reg.dp_rank, pp_rank=reg.pp_rank,
        )

    def start(self) -> RegistrationKeeper:
        self._thread.start()
        return self

    def wait_registered(self, timeout_s: float) -> bool:
        return self._registered.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)

    def _register(self) -> None:
        self.client.register(self.reg)
        self.registrations += 1
        self._registered.set()
        log.info("registered %s %s with %s", self.reg.role, self.reg.instance_id, self.client.url)

    def _run(self) -> None:
        delay = min(0.5, self.interval_s)
        while not self._stop.is_set():
            try:
                if not self._registered.is_set():
                    self._register()
                elif not self.client.heartbeat(self._hb):
                    log.warning("bootstrap server forgot %s; registering again", self.reg.instance_id)
                    self._register()
                else:
                    self._fault.tick()
                delay = self.interval_s
            except BootstrapError as exc:
                log.warning("%s (retrying)", exc)
                delay = min(self.interval_s, 1.0)
            self._stop.wait(delay)
