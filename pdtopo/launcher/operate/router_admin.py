"""The router's worker registry, as sglang-router (proxy.kind=rust) and the model gateway
(proxy.kind=gateway) both offer it: `GET /workers` lists workers with `id`, `url`,
`worker_type` and `is_healthy`; `POST /workers {url, worker_type, bootstrap_port}` queues an
addition; `DELETE /workers/<id>` queues a removal. Both act in the background, so callers
wait for the list to show the change.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdtopo.launcher.operate.admin_http import OperationError, admin_request
from pdtopo.launcher.plan.expand import Process


def router_url(proxy: Process) -> str:
    """The base URL of the deployment's proxy process, where its registry answers."""
    return f"http://{proxy.address}:{proxy.ports['http']}"


@dataclass(frozen=True)
class RouterAdmin:
    url: str | None          # the proxy's base URL (None: no proxy in the plan)
    api_key: str | None = None

    def workers(self) -> list[dict] | None:
        """The router's worker list, or None when it does not answer one."""
        if self.url is None:
            return None
        try:
            body = admin_request(f"{self.url}/workers", token=self.api_key, timeout=2.0)
        except OperationError:
            return None
        workers = body.get("workers") if isinstance(body, dict) else None
        return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else None

    def entry(self, worker_url: str) -> dict | None:
        """The router's entry for one worker, None when it is not listed; OperationError when
        the router does not answer its list (not the same as "not listed")."""
        workers = self.workers()
        if workers is None:
            raise OperationError(f"the router at {self.url} does not answer GET /workers")
        return next((w for w in workers if w.get("url") == worker_url), None)

    def health(self, worker_url: str) -> bool | None:
        """True/False from the router's list, None when it does not list the worker with a
        health flag."""
        try:
            found = self.entry(worker_url)
        except OperationError:
            return None
        if found is None or "is_healthy" not in found:
            return None
        return bool(found["is_healthy"])

    def listed(self, worker_url: str) -> bool:
        return self.entry(worker_url) is not None

    def answers_listed(self, worker_url: str, listed: bool) -> bool:
        """For polling: True once the router answers and lists (or, `listed=False`, does not
        list) the worker; a router that does not answer is "not yet", never "gone"."""
        try:
            return self.listed(worker_url) is listed
        except OperationError:
            return False

    def add(self, leader: Process) -> None:
        if self.url is None:
            raise OperationError("the deployment has no proxy to add workers to")
        spec: dict = {"url": leader.url, "worker_type": leader.role}
        if leader.role == "prefill":
            spec["bootstrap_port"] = int(leader.ports["zmq"])
        admin_request(f"{self.url}/workers", body=spec, token=self.api_key)

    def remove(self, leader: Process) -> None:
        found = self.entry(leader.url)
        if found is None:
            return
        if "id" not in found:
            raise OperationError(f"the router lists {leader.url} without an id to remove it by")
        admin_request(f"{self.url}/workers/{found['id']}", method="DELETE", token=self.api_key)
