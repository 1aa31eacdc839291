"""Semantic diff of two deployments (config A vs config B, or conf/ at a git rev vs now).

`diff_configs(cfg_a, cfg_b)` expands both plans with the same neutral run dir, interpreter,
token and cores, then compares: config keys (flattened, resolved), processes added/removed,
per-process fields (chips, ports, env, command, ...), and a unified diff of the rendered
supervisord.conf. `conf_at_rev(rev)` extracts conf/ from git into a temp dir. Output as rich
tables or Markdown. Exit status like diff(1): 0 identical, 1 different, 2 error.
"""

from __future__ import annotations

import difflib
import io
import shlex
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from pdtopo.launcher.plan.expand import Plan, expand_plan
from pdtopo.launcher.render.supervisord import program_settings, render_supervisord

NEUTRAL_RUN_DIR = "RUN_DIR"
NEUTRAL_PYTHON = "python"
NEUTRAL_TOKEN = "TOKEN"
SECRET_MASK = "<secret>"  # what a diff shows for a secret value (the proxy API key)
SECRET_KEYS = frozenset({"proxy.api_key"})
NEUTRAL_WORKDIR = "WORKDIR"
MISSING = "<absent>"


@dataclass
class DiffResult:
    label_a: str
    label_b: str
    config: list[tuple[str, Any, Any]] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    processes: dict[str, list[tuple[str, Any, Any]]] = field(default_factory=dict)
    conf_diff: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.config or self.added or self.removed or self.processes
                    or self.conf_diff)


def label_of(overrides: list[str]) -> str:
    """A side's label from its overrides, secrets masked."""
    return " ".join(f"{o.split('=', 1)[0]}={SECRET_MASK}" if o.lstrip("+~").split("=", 1)[0]
                    in SECRET_KEYS else o for o in overrides) or "defaults"


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    if isinstance(node, list) and any(isinstance(x, (dict, list)) for x in node):
        out = {}
        for i, v in enumerate(node):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out or {prefix[:-1]: []}
    return {prefix[:-1]: node}


def config_changes(cfg_a: DictConfig, cfg_b: DictConfig) -> list[tuple[str, Any, Any]]:
    a = _flatten({k: v for k, v in OmegaConf.to_container(cfg_a, resolve=True).items()
                  if k != "hydra"})
    b = _flatten({k: v for k, v in OmegaConf.to_container(cfg_b, resolve=True).items()
                  if k != "hydra"})
    def shown(key: str, value: Any) -> Any:  # a changed secret shows as changed, not its value
        return SECRET_MASK if key in SECRET_KEYS and value not in (None, MISSING) else value

    return [(k, shown(k, a.get(k, MISSING)), shown(k, b.get(k, MISSING)))
            for k in sorted(set(a) | set(b)) if a.get(k, MISSING) != b.get(k, MISSING)]


def _dict_changes(name: str, a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    return [(f"{name}.{k}", a.get(k, MISSING), b.get(k, MISSING))
            for k in sorted(set(a) | set(b)) if a.get(k, MISSING) != b.get(k, MISSING)]


def process_changes(pa: dict, pb: dict) -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for key in pa.keys() | pb.keys():
        va, vb = pa.get(key, MISSING), pb.get(key, MISSING)
        if va == vb:
            continue
        if key in ("env", "ports", "rank", "mesh") and isinstance(va, dict) \
                and isinstance(vb, dict):
            out += _dict_changes(key, va, vb)
        elif key == "command":
            out.append((key, shlex.join(va), shlex.join(vb)))
        else:
            out.append((key, va, vb))
    order = ["role", "host", "address", "chips", "mesh", "rank", "ports", "env", "cpu_affinity",
             "command", "health_url", "priority"]
    return sorted(out, key=lambda c: (order.index(c[0].split(".")[0])
                                      if c[0].split(".")[0] in order else 99, c[0]))


def render_neutral(cfg: DictConfig, plan: Plan) -> str:
    """supervisord.conf with neutral paths and token, and secrets (the proxy API key) masked:
    a diff is for review and ends up in terminals, PRs and files."""
    plan = replace(plan, processes=[
        replace(p, secret_env={k: SECRET_MASK for k in p.secret_env}) for p in plan.processes])
    return render_supervisord(plan, run_dir=NEUTRAL_RUN_DIR, token=NEUTRAL_TOKEN,
                              workdir=NEUTRAL_WORKDIR, settings=program_settings(cfg))


def diff_configs(cfg_a: DictConfig, cfg_b: DictConfig, cpus: list[int],
                 label_a: str = "A", label_b: str = "B") -> DiffResult:
    plan_a = expand_plan(cfg_a, run_dir=NEUTRAL_RUN_DIR, python=NEUTRAL_PYTHON, cpus=cpus)
    plan_b = expand_plan(cfg_b, run_dir=NEUTRAL_RUN_DIR, python=NEUTRAL_PYTHON, cpus=cpus)
    res = DiffResult(label_a, label_b, config=config_changes(cfg_a, cfg_b))
    da = {p.name: p.to_dict() for p in plan_a.processes}
    db = {p.name: p.to_dict() for p in plan_b.processes}
    res.removed = [n for n in da if n not in db]
    res.added = [n for n in db if n not in da]
    for name in da:
        if name in db:
            changes = process_changes(da[name], db[name])
            if changes:
                res.processes[name] = changes
    conf_a = render_neutral(cfg_a, plan_a).splitlines()
    conf_b = render_neutral(cfg_b, plan_b).splitlines()
    res.conf_diff = list(difflib.unified_diff(conf_a, conf_b, f"{label_a}/supervisord.conf",
                                              f"{label_b}/supervisord.conf", lineterm=""))
    return res


def conf_at_rev(rev: str, conf: Path, dest: Path) -> Path:
    """Extract the conf/ directory as of git revision `rev` into dest; return its path."""
    top = subprocess.run(["git", "-C", str(conf), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    if top.returncode != 0:
        raise RuntimeError(f"{conf} is not inside a git checkout: {top.stderr.strip()}")
    rel = conf.resolve().relative_to(Path(top.stdout.strip()).resolve()).as_posix()
    archive = subprocess.run(["git", "-C", top.stdout.strip(), "archive", "--format=tar", rev,
                              rel], capture_output=True)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {rev} {rel} failed: "
                           f"{archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest / rel


def temp_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="pdtopo-diff-")


def _fmt(value: Any) -> str:
    return MISSING if value == MISSING else repr(value) if not isinstance(value, str) else value


def print_rich(res: DiffResult, con: Console) -> None:
    if res.identical:
        con.print(f"no differences between {res.label_a} and {res.label_b}")
        return
    if res.config:
        t = Table(title="config keys changed")
        for col in ("key", res.label_a, res.label_b):
            t.add_column(col, overflow="fold")
        for key, a, b in res.config:
            t.add_row(key, _fmt(a), _fmt(b))
        con.print(t)
    if res.added or res.removed:
        con.print("[bold]processes[/]: " + "  ".join(
            [f"[green]+{n}[/]" for n in res.added] + [f"[red]-{n}[/]" for n in res.removed]))
    for name, changes in res.processes.items():
        t = Table(title=f"process {name}")
        for col in ("field", res.label_a, res.label_b):
            t.add_column(col, overflow="fold")
        for key, a, b in changes:
            t.add_row(key, _fmt(a), _fmt(b))
        con.print(t)
    if res.conf_diff:
        con.rule("supervisord.conf")
        for line in res.conf_diff:
            style = "green" if line.startswith("+") else "red" if line.startswith("-") else \
                "cyan" if line.startswith("@@") else ""
            con.print(f"[{style}]{_esc(line)}[/]" if style else _esc(line), soft_wrap=True,
                      highlight=False)


def _esc(text: str) -> str:
    return text.replace("[", "\\[")


def _md_cell(value: Any) -> str:
    return "`" + _fmt(value).replace("|", "\\|").replace("`", "'") + "`"


def to_markdown(res: DiffResult) -> str:
    if res.identical:
        return f"No differences between `{res.label_a}` and `{res.label_b}`.\n"
    out = [f"## pdtopo diff: `{res.label_a}` → `{res.label_b}`", ""]
    if res.config:
        out += ["### Config keys changed", "", f"| key | {res.label_a} | {res.label_b} |",
                "|---|---|---|"]
        out += [f"| `{k}` | {_md_cell(a)} | {_md_cell(b)} |" for k, a, b in res.config]
        out.append("")
    if res.added or res.removed:
        out += ["### Processes", ""]
        out += [f"- added: `{n}`" for n in res.added]
        out += [f"- removed: `{n}`" for n in res.removed]
        out.append("")
    for name, changes in res.processes.items():
        out += [f"### Process `{name}`", "", f"| field | {res.label_a} | {res.label_b} |",
                "|---|---|---|"]
        out += [f"| {k} | {_md_cell(a)} | {_md_cell(b)} |" for k, a, b in changes]
        out.append("")
    if res.conf_diff:
        out += ["### supervisord.conf", "", "```diff", *res.conf_diff, "```", ""]
    return "\n".join(out)
