"""What the planner may hold: instance counts per role (`Counts`) and the limits every target
is checked against (`Budget`: chips, chips per instance of each role, instance bounds). Pure.

    counts = Counts(prefill=1, decode=1)
    budget = Budget(chips=3, prefill_chips=1, decode_chips=1)
    budget.refusal(counts.add("prefill", 1))   # None: allowed; else why not, for the reason
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode")


def other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


@dataclass(frozen=True)
class Counts:
    prefill: int
    decode: int

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode

    def add(self, role: str, n: int) -> Counts:
        return Counts(self.prefill + n, self.decode) if role == "prefill" \
            else Counts(self.prefill, self.decode + n)

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"

    def to_dict(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True)
class Budget:
    """`chips`: what the planner may hold in all (None: only the bounds limit it); an instance
    of a role holds `<role>_chips`; counts stay within [min, max] per role, and never below
    one P and one D whatever the bounds say."""

    chips: int | None
    prefill_chips: int = 1
    decode_chips: int = 1
    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None

    def chips_of(self, counts: Counts) -> int:
        return counts.prefill * self.prefill_chips + counts.decode * self.decode_chips

    def bounds(self, role: str) -> tuple[int, int | None]:
        lo, hi = (self.min_prefill, self.max_prefill) if role == "prefill" \
            else (self.min_decode, self.max_decode)
        return max(1, lo), hi

    def refusal(self, counts: Counts) -> str | None:
        """None when `counts` fits; otherwise why not (said the way a decision reason is)."""
        for role in ROLES:
            lo, hi = self.bounds(role)
            n = counts.of(role)
            if n < lo:
                return f"{role} would go below its minimum of {lo}"
            if hi is not None and n > hi:
                return f"{role} would go above its maximum of {hi}"
        if self.chips is not None and self.chips_of(counts) > self.chips:
            return (f"{counts} needs {self.chips_of(counts)} chips, the budget is "
                    f"{self.chips}")
        return None

    def to_dict(self) -> dict:
        return {"chips": self.chips, "prefill_chips": self.prefill_chips,
                "decode_chips": self.decode_chips,
                "prefill": [self.min_prefill, self.max_prefill],
                "decode": [self.min_decode, self.max_decode]}
