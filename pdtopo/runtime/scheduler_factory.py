"""Assemble the scheduler for a server process from its role.

`make_scheduler(ctx, runner, tokenizer)`: role `colocated` -> the plain `Scheduler`; `prefill` /
`decode` -> the PD schedulers (Scheduler + disaggregation mixins), which are not assembled here
yet. Role-specific behaviour lives in those mixins, not in branches inside the engine.
"""

from __future__ import annotations

from pdtopo.runtime.scheduler import Scheduler


def make_scheduler(ctx, runner, tokenizer, metrics=None) -> Scheduler:
    role = ctx.role
    if role == "colocated":
        return Scheduler(ctx, runner, tokenizer, metrics=metrics)
    if role in ("prefill", "decode"):
        raise NotImplementedError(
            f"the {role} scheduler (PD disaggregation mixins) is not implemented yet; "
            "start the server with role colocated")
    raise ValueError(f"process {ctx.name!r} has role {role!r}: a server needs role "
                     "colocated, prefill or decode")
