"""The PD timeline of one request, as D reports it in `meta_info.pd_timeline` (milliseconds).

D composes it when the request joins its decode batch, from P's stages (seconds on P's clock,
carried by `ready`.p_stages) and its own receiver's stage times (D's monotonic clock). No
duration is a difference of two processes' clocks:

    p_queue        P: arrival -> first prefill chunk scheduled
    p_prefill      P: first chunk -> prefill done (the first token sampled)
    p_send         P: prefill done -> `ready` sent (KV registered; waiting for D's want)
    d_wait_ready   D: arrival -> `ready` received (P's three stages run inside it)
    transit        d_wait_ready - (p_queue + p_prefill + p_send): the router's skew between
                   sending to P and to D, plus the side channel's delivery (negative when P
                   got the request before D)
    d_pull_queue   D: `ready` -> pull start (waiting for pages or the pull executor)
    d_transfer     D: pull start -> KV in hand
    d_scatter      D: KV in hand -> written into the pool, `done` sent
    d_first_token  D: scattered -> the request joins the decode batch with P's first token
    d_ttft         D: arrival -> first token; equals d_wait_ready + d_pull_queue +
                   d_transfer + d_scatter + d_first_token
"""

from __future__ import annotations

D_STAGES = ("d_wait_ready", "d_pull_queue", "d_transfer", "d_scatter", "d_first_token")
P_KEYS = {"queue": "p_queue", "prefill": "p_prefill", "send": "p_send"}


def decode_timeline(arrival: float, times: dict[str, float], p_stages: dict[str, float],
                    first_token: float) -> dict[str, float] | None:
    """The timeline in ms, or None when a stage time is missing (e.g. no pull happened)."""
    needed = ("ready", "pull_start", "pull_end", "scattered")
    if any(k not in times for k in needed):
        return None
    points = [arrival, times["ready"], times["pull_start"], times["pull_end"],
              times["scattered"], first_token]
    ms = {name: (b - a) * 1e3 for name, a, b in zip(D_STAGES, points[:-1], points[1:],
                                                    strict=True)}
    out = {P_KEYS[k]: v * 1e3 for k, v in p_stages.items() if k in P_KEYS}
    out.update(ms)
    if len(out) == len(P_KEYS) + len(D_STAGES):
        out["transit"] = ms["d_wait_ready"] - sum(out[k] for k in P_KEYS.values())
    out["d_ttft"] = (first_token - arrival) * 1e3
    return {k: round(v, 3) for k, v in out.items()}
