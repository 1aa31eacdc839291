"""P's budget of held KV copies: `disaggregation.max_held_kv_pages` and `held_kv_wait_s`.

P gathers a finished prefill's prompt pages into packed copies, frees the pool pages, and keeps
the copies until D pulls them or they expire (`sender_expiry_s`); a slow or page-starved D would
otherwise let them grow with arrival rate x wait. `HeldKVBudget` bounds them in pages (a copy
of n pages takes as many bytes on each device as n pool pages). It is owned by P's scheduler
thread, like the senders whose pages it counts. Data flow:

    schedule_prefill -> P's may_start(req) -> admits(rid, prompt pages, held pages): starts
                        when the pages held by announced copies + the pages the admitted,
                        not yet sent requests will copy + this prompt's fit the budget;
                        otherwise the request waits (FCFS) and `blocked` is set
    P's finish_request -> settle(rid): its copy now counts through its sender (or never)
    every step, while blocked -> overdue(arrival, now): requests held back longer than
                        held_kv_wait_s fail with `wait_error` (503: another P or a retry later
                        can serve them)

The copies' pages come from the prompt: a prompt larger than the budget can never start and is
refused at once (`prompt_problem`, 400).
"""

from __future__ import annotations

from pdtopo.config.settings import check_value


class HeldKVBudget:
    """Admission of P's prefills by the pages their KV copies will hold (module docstring)."""

    def __init__(self, max_pages: int, wait_s: float) -> None:
        self.max_pages = int(check_value("disaggregation.max_held_kv_pages", max_pages))
        self.wait_s = float(check_value("disaggregation.held_kv_wait_s", wait_s))
        self._admitted: dict[str, int] = {}  # rid -> pages its copy will hold, until it is sent
        self.blocked = False                 # the last decision held a request back

    def committed(self) -> int:
        """Pages the admitted, not yet sent requests will copy."""
        return sum(self._admitted.values())

    def is_admitted(self, rid: str) -> bool:
        return rid in self._admitted

    def fits(self, pages: int, held_pages: int) -> bool:
        return held_pages + self.committed() + pages <= self.max_pages

    def admits(self, rid: str, pages: int, held_pages: int) -> bool:
        """Whether request `rid`, whose copy will take `pages`, may start its prefill now
        (`held_pages`: what announced copies hold). Admitting reserves its pages."""
        if rid in self._admitted:
            return True
        if not self.fits(pages, held_pages):
            self.blocked = True
            return False
        self._admitted[rid] = int(pages)
        self.blocked = False
        return True

    def settle(self, rid: str) -> None:
        """Request `rid` ended: sent (its sender's pages count from now on) or failed."""
        self._admitted.pop(rid, None)

    def overdue(self, arrival: float, now: float) -> bool:
        return now - arrival >= self.wait_s

    def prompt_problem(self, pages: int, prompt_len: int) -> str | None:
        """Why a prompt can never start on this P (None if it can)."""
        if pages <= self.max_pages:
            return None
        return (f"the prompt ({prompt_len} tokens) needs {pages} KV pages held for the decode "
                f"server's pull; this prefill server holds at most "
                f"disaggregation.max_held_kv_pages={self.max_pages}")

    def wait_error(self, held_pages: int, waited_s: float) -> str:
        return (f"the prefill server holds {held_pages} pages of KV copies waiting for decode "
                f"servers to pull them, at its budget disaggregation.max_held_kv_pages="
                f"{self.max_pages}; this request waited {waited_s:.1f} s for room "
                f"(disaggregation.held_kv_wait_s={self.wait_s:g}); retry later")
