"""The attention path a runner serves with, and what happens when Mosaic refuses the TPU kernel.

On a TPU `engine.attention_impl=auto` resolves to pdtopo's Pallas kernel (`KERNEL_NAME`; its
pallas_calls are named `pdtopo_ragged...`), which Mosaic compiles when the runner first compiles
a kernel step: the pool sizing's compile of the largest step (`ModelRunner.step_memory_bytes`)
and warmup (`ModelRunner.warmup`, every shape of the ragged grid, then a first run). If that
raises (lowering, Mosaic's compile, or the first run), the runner (`ModelRunner._kernel_refused`)
  - with `auto`: logs an ERROR naming the kernel, the step shape and the error's first lines,
    switches to the gather path (impl "gather", the paged layouts: new geometry, new step
    programs) and warms that up instead, so nothing compiles while serving; `AttentionPath`
    keeps why, shown as "gather (pallas refused: <message>)": `attention` in /pdtopo/state
    (the scheduler's stats), `pdtopo:attention_info` in /metrics, the launch table;
  - with the kernel asked for by name (`pallas`, or `pallas_interpret`): fails the start with
    `KernelRefused`, naming the setting, the step shape and the way out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KERNEL_NAME = "pdtopo ragged paged attention"
REASON_CHARS = 160  # the reason kept for the label (one line)
DETAIL_CHARS = 600  # the error text the ERROR log and KernelRefused carry (first lines)
DETAIL_LINES = 3


class KernelRefused(RuntimeError):
    """The TPU kernel, asked for by name, failed to compile for a step shape."""


@dataclass(frozen=True)
class AttentionPath:
    impl: str                            # what runs: gather | pallas | pallas_interpret
    requested: str                       # engine.attention_impl
    fallback_reason: str | None = None   # the kernel's error (short) when auto fell back

    @property
    def label(self) -> str:
        if self.fallback_reason is None:
            return self.impl
        return f"{self.impl} (pallas refused: {self.fallback_reason})"


def _lines(exc: BaseException) -> list[str]:
    lines = [" ".join(line.split()) for line in str(exc).splitlines()]
    return [line for line in lines if line] or [type(exc).__name__]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def short_reason(exc: BaseException) -> str:
    """The error's first non-empty line, at most REASON_CHARS (Mosaic's first line names the
    refusal; what follows is the MLIR it refused)."""
    return _clip(_lines(exc)[0], REASON_CHARS)


def error_detail(exc: BaseException) -> str:
    """The error's type and first lines, at most DETAIL_CHARS."""
    return _clip(f"{type(exc).__name__}: " + " | ".join(_lines(exc)[:DETAIL_LINES]),
                 DETAIL_CHARS)


def shape_text(key: tuple) -> str:
    """A StepKey as the runner's logs write it (layout/tokens/rows), then the whole key."""
    return f"{'/'.join(str(k) for k in key[:3])} (StepKey {key!r})"


def refusal_error(requested: str, key: tuple, exc: BaseException) -> KernelRefused:
    return KernelRefused(
        f"engine.attention_impl={requested}: the TPU kernel ({KERNEL_NAME}) failed to compile "
        f"for step shape {shape_text(key)}: {error_detail(exc)}; use "
        "engine.attention_impl=auto to fall back to the gather path, or gather")


def attention_label(paths: Sequence[AttentionPath]) -> str | None:
    """One label for a process's runners (several in local mode): the distinct labels in
    order, joined by "; "; None without a runner that says."""
    labels = list(dict.fromkeys(p.label for p in paths))
    return "; ".join(labels) if labels else None
