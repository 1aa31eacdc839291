"""What the prefill and decode scheduler mixins share: the KV manager, the process's bootstrap
registration, the identity that peers compare, and the loop cadence while transfers are pending.

`DisaggregationMixinBase.__init__` runs after the engine's `Scheduler.__init__` (it needs the
runner's pool to describe it): it builds the `JaxTransferKVManager` (transfer server + ZMQ side
channel) from the process context, registers the runner, and prepares this rank's
`Registration`. `start()` starts the registration keeper (register, heartbeat, re-register after
a bootstrap restart) before the scheduler thread; `stop()` undoes both.
"""

from __future__ import annotations

import logging
from typing import Any

from pdtopo.model_config.shapes import kv_replication
from pdtopo.runtime.bootstrap.client import BootstrapClient, RegistrationKeeper
from pdtopo.runtime.bootstrap.protocol import Registration
from pdtopo.runtime.disagg.observability import PDMetrics
from pdtopo.runtime.disagg.reshard.layout import (
    KVShardLayout,
    instance_layouts,
    same_layout,
)
from pdtopo.runtime.disagg.transport.base import KVArgs, PoolTransferSpec
from pdtopo.runtime.disagg.transport.manager import JaxTransferKVManager
from pdtopo.runtime.worker_threads import server_fault

log = logging.getLogger("pdtopo.disagg")

# While a transfer is pending the loop polls the side channel this often (seconds); it is the
# main contributor to PD's added latency, so keep it short. Idle servers wait longer.
PENDING_POLL_S = 0.001


def model_identity(cfg) -> str:
    """A string two servers must share to exchange KV: architecture, weights and dtype."""
    m = cfg.model
    weights = f"path={m.path}" if m.get("path") else f"seed={m.get('init_seed')}"
    return f"{m.name}|{m.architecture}|{weights}|{cfg.engine.dtype}"


def _or_none(fn):
    """`fn`, answering None where it raises ValueError (a tp the model cannot split for: that
    instance refuses to start on its own)."""
    def wrapped(*args):
        try:
            return fn(*args)
        except ValueError:
            return None
    return wrapped


class DisaggregationMixinBase:
    """State and lifecycle shared by the P and D mixins (see the module docstring)."""

    def _init_disaggregation(self) -> None:
        ctx = self.ctx
        self.kv_args = KVArgs(pools=[PoolTransferSpec.from_kv_caches(self.runner.kv_caches)])
        self.kv_manager = JaxTransferKVManager.from_context(ctx, self.kv_args)
        self.kv_manager.register_runner(self.runner)
        channel = self.kv_manager.channel
        self.pd_metrics = PDMetrics(self.metrics.registry,
                                    lambda: channel.stats().get("dropped", 0))
        self.registration = self._build_registration()
        self.bootstrap = BootstrapClient(ctx.bootstrap_url, ctx.token) if ctx.bootstrap_url else None
        self._keeper: RegistrationKeeper | None = None

    def _build_registration(self) -> Registration:
        ctx, cfg = self.ctx, self.ctx.cfg
        layout = self.runner.kv_layout()
        zmq_addr = (self.kv_manager.channel.address
                    or f"{ctx.address}:{int(ctx.ports.get('zmq') or 1)}")
        http = ctx.ports.get("http")
        return Registration(
            role=ctx.role,
            instance_id=str(ctx.process.get("instance_id", ctx.name)),
            **ctx.rank,
            transfer_addr=self.kv_manager.engine.address,
            zmq_addr=zmq_addr,
            http_addr=f"{ctx.address}:{http}" if http else None,
            page_size=int(self.runner.page_size),
            kv_dtype=layout["dtype"],  # resolved: engine.kv_dtype "auto" depends on the platform
            model=model_identity(cfg),
            kv_layout={k: (list(v) if isinstance(v, tuple) else v) for k, v in layout.items()},
            mesh_meta={"tp": int(ctx.process.get("mesh", {}).get("tp", 1))},
        )

    def peer_layouts(self, role: str) -> list[KVShardLayout]:
        """The KV shard layouts of the plan's `role` instances that differ from this pool's
        (those a transfer reshards for): from their mesh tp and process count."""
        mine = self.kv_manager.layout
        model = self.runner.model_config

        def pool_heads(tp: int) -> int:
            return model.num_kv_heads * kv_replication(model, tp)

        out = []
        for layout in instance_layouts(self.ctx.plan.get("processes", []), role,
                                       model.num_kv_heads, _or_none(pool_heads)).values():
            if layout is not None and not same_layout(layout, mine) and layout not in out:
                out.append(layout)
        return out

    @property
    def registration_info(self) -> dict[str, Any]:
        return self.registration.model_dump()

    def reject_room(self, room: int, message: str, status: int = 400) -> None:
        """Thread-safe: the HTTP layer rejected a request of `room` before it reached the
        scheduler; the scheduler thread tells the PD peer (`_reject_room`)."""
        self.inbox.put(("reject_room", (int(room), str(message), int(status))))

    def dispatch(self, msg: tuple[Any, Any]) -> None:
        if msg[0] == "reject_room":
            self._reject_room(*msg[1])
        else:
            super().dispatch(msg)

    def _reject_room(self, room: int, message: str, status: int) -> None:
        """Nothing to tell by default (D's own rejection needs no message to P)."""

    def pd_state(self) -> dict[str, Any]:
        channel = self.kv_manager.channel
        stats = channel.stats()
        return {"pd_side_channel_received": sum(v for k, v in stats.items()
                                                 if k.startswith("recv_")),
                "pd_side_channel_dropped": stats.get("dropped", 0),
                "pd_side_channel_curve": channel.curve is not None,
                "pd_side_channel_curve_denied": stats.get("curve_denied", 0)}

    def extra_stats(self) -> dict[str, Any]:
        if getattr(self, "kv_manager", None) is None:
            return {}  # called from Scheduler.__init__, before the mixin is set up
        return {**super().extra_stats(), **self.pd_state()}

    def start(self) -> None:
        if self.bootstrap is not None:
            boot = self.ctx.settings.bootstrap
            self._keeper = RegistrationKeeper(
                self.bootstrap, self.registration, boot.heartbeat_interval_s,
                fault=server_fault(self.ctx.settings, "bootstrap_keeper")).start()
            timeout = boot.register_timeout_s
            if not self._keeper.wait_registered(timeout):
                self._keeper.stop()
                raise RuntimeError(
                    f"could not register with the bootstrap server {self.bootstrap.url} within "
                    f"{timeout:g}s (bootstrap.register_timeout_s); see the warnings above")
        else:
            log.warning("no bootstrap server in this process's plan: not registering")
        # the snapshot published in Scheduler.__init__ predates the mixin's state: republish
        # before the loop starts, so a reader never sees one without the pd_* counters
        self.publish_stats()
        super().start()

    def wait_registered(self, timeout_s: float) -> bool:
        return self._keeper is None or self._keeper.wait_registered(timeout_s)

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)
        if self._keeper is not None:
            self._keeper.stop()
        self.kv_manager.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
