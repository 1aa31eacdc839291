"""Rich terminal output of the launcher: errors, the live health table, endpoints, status."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pdtopo.config.schema import TopologyError
from pdtopo.launcher.operate.health import Row
from pdtopo.launcher.plan.expand import Plan

STATE_STYLE = {"RUNNING": "green", "STARTING": "yellow", "BACKOFF": "yellow", "FATAL": "red",
               "EXITED": "red", "STOPPED": "dim", "UNKNOWN": "dim"}


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def print_topology_error(err: TopologyError, con: Console | None = None) -> None:
    con = con or console(stderr=True)
    kind = getattr(err, "kind", "topology")  # "model" for the model pre-flight's errors
    con.print(f"[bold red]{kind} error[/] in [bold]{err.key}[/] = [bold]{err.value!r}[/]: "
              f"{err.message}", soft_wrap=True)


def health_table(plan: Plan, rows: list[Row], title: str = "pdtopo launch",
                 kv_pools: dict[str, str] | None = None) -> Table:
    """The live launch table; `kv_pools` (program -> its KV pool, `plan.kv_pool`) adds a
    column so the pool each instance gets shows before traffic does; once a server is healthy
    and says which attention path it serves with (`Row.attention`), an attention column."""
    procs = plan.by_name()
    table = Table(title=title)
    attention = any(row.attention for row in rows)
    for col in ("program", "role", "state", "pid", "health", "waited", "progress",
                *(["KV pool"] if kv_pools else []), *(["attention"] if attention else []),
                "health url"):
        table.add_column(col)
    for row in rows:
        proc = procs[row.name]
        style = STATE_STYLE.get(row.state, "")
        health = "[green]healthy[/]" if row.healthy else "[yellow]waiting[/]"
        pool = [kv_pools.get(row.name, "-")] if kv_pools else []
        path = [_attention_cell(row.attention)] if attention else []
        table.add_row(row.name, proc.role, f"[{style}]{row.state}[/]" if style else row.state,
                      str(row.pid or "-"), health, f"{row.waited_s:.1f}s",
                      row.progress or "-", *pool, *path, proc.health_url)
    return table


def _attention_cell(attention: str) -> Text | str:
    """A fallback from the TPU kernel ("gather (pallas refused: ...)") shows in red."""
    if not attention:
        return "-"
    return Text(attention, style="red" if "refused" in attention else "")


def endpoints_text(plan: Plan, api_key_file: Path | None = None) -> list[str]:
    """`api_key_file`: where the derived proxy API key is, when the plan uses one."""
    lines = []
    if plan.proxy_url:
        lines.append(f"proxy      {plan.proxy_url}   (send requests here)")
    if api_key_file is not None:
        lines.append(f"api key    {api_key_file}   (send 'Authorization: Bearer <key>' to the "
                     "proxy; derived from the deployment token because P/D require a "
                     "credential: server.http_auth)")
    if plan.bootstrap_url:
        lines.append(f"bootstrap  {plan.bootstrap_url}")
    for p in plan.processes:
        if p.role in ("prefill", "decode", "colocated", "local"):
            chips = ",".join(map(str, p.chips))
            lines.append(f"{p.name:<10} {p.url}   chips {chips}")
    return lines


def status_table(plan: Plan | None, infos: list[dict], healthy: dict[str, bool],
                 title: str) -> Table:
    procs = plan.by_name() if plan else {}
    table = Table(title=title)
    for col in ("program", "state", "pid", "uptime", "health", "url"):
        table.add_column(col)
    for info in infos:
        name = info["name"]
        style = STATE_STYLE.get(info["statename"], "")
        url = procs[name].health_url if name in procs else "-"
        uptime = "-"
        if info["statename"] == "RUNNING" and info.get("now") and info.get("start"):
            uptime = f"{info['now'] - info['start']}s"
        ok = healthy.get(name)
        health = "-" if ok is None else ("[green]healthy[/]" if ok else "[red]unhealthy[/]")
        table.add_row(name, f"[{style}]{info['statename']}[/]", str(info.get("pid") or "-"),
                      uptime, health, url)
    return table
