"""Assemble the scheduler for a server process from its role.

`make_scheduler(ctx, runner, tokenizer)`: role `colocated` -> the plain `Scheduler`; `prefill` ->
`PrefillScheduler` and `decode` -> `DecodeScheduler`, the engine's scheduler with the PD
disaggregation mixins in front of it. Role-specific behaviour lives in those mixins, not in
branches inside the engine. On the leader of a multi-process instance the runner is wrapped
first (`pdtopo.runtime.distributed.leader.attach_leader`): forwards and KV pool operations are
replayed on the instance's follower processes.
"""

from __future__ import annotations

from pdtopo.runtime.disagg.decode import SchedulerDisaggregationDecodeMixin
from pdtopo.runtime.disagg.prefill import SchedulerDisaggregationPrefillMixin
from pdtopo.runtime.distributed.leader import attach_leader, exit_on_follower_loss
from pdtopo.runtime.engine.scheduler import Scheduler


class PrefillScheduler(SchedulerDisaggregationPrefillMixin, Scheduler):
    """P: prefill, then hand the KV and the first token to D."""


class DecodeScheduler(SchedulerDisaggregationDecodeMixin, Scheduler):
    """D: pull the KV from P, then decode."""


SCHEDULERS: dict[str, type[Scheduler]] = {
    "colocated": Scheduler,
    "prefill": PrefillScheduler,
    "decode": DecodeScheduler,
}


def make_scheduler(ctx, runner, tokenizer, metrics=None) -> Scheduler:
    cls = SCHEDULERS.get(ctx.role)
    if cls is None:
        raise ValueError(f"process {ctx.name!r} has role {ctx.role!r}: a server needs one of "
                         f"{', '.join(SCHEDULERS)}")
    runner = attach_leader(ctx, runner)  # multi-process instance: followers in lockstep
    scheduler = cls(ctx, runner, tokenizer, metrics=metrics)
    exit_on_follower_loss(scheduler)  # a dead follower: end the requests, restart the instance
    return scheduler
