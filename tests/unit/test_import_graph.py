"""The package's import graph, read statically (every module parsed, imports inside functions
and under `if TYPE_CHECKING:` included: an annotation-only import still ties two modules into a
loop): no cycles between modules, nor between the top-level rooms; the engine knows nothing of
disaggregation, local mode, HTTP or multi-process instances; the launcher uses no runtime
internals and the benchmark package nothing of the launcher; the planner's pure core
nothing of the runtime, the launcher or tune; the launcher's sub-packages import
one way (plan <- render <- operate <- programs) and only the CLI imports the launch job;
disaggregation's transport never imports its roles and its reshard imports transport at most;
the runtime's top level keeps at most four modules; no module under pdtopo/ runs past 600
lines, and a package's face (`__init__.py`) holds no code, only its docstring and re-exports;
benchmarks use pdtopo, never tests/; and every function-level import is a dependency deferred
on purpose, saying so in a `# deferred: why` comment on its line or the line above."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.constants import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "pdtopo"

DEFERRED = "# deferred:"  # the comment that keeps a function-level import (heavy dependency)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The pdtopo module an imported dotted name refers to (a module or a name in one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, package: str | None = None) -> list[tuple[str, int, bool]]:
    """(imported dotted name, line, inside a function?) of every import in `path` (a module
    of `package`, by default the one its place in the tree says)."""
    tree = ast.parse(path.read_text(), str(path))
    if package is None:
        package = _module_name(path) if path.name == "__init__.py" else \
            _module_name(path).rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, nested) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                found.extend((f"{base}.{a.name}" if base else a.name, child.lineno, nested)
                             for a in child.names)
            else:
                visit(child, inner)

    visit(tree, False)
    return found


GRAPH = {
    mod: sorted({target for name, _, _ in _imports(path)
                 if (target := _resolve(name)) and target != mod})
    for mod, path in MODULES.items()
}


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def _is_package_parent(child: str, parent: str) -> bool:
    """`parent` is a package __init__ that `child` lives in (its own package, not a cycle)."""
    return child.startswith(parent + ".")


def test_no_import_cycles():
    # a module importing its own package's __init__ is how Python loads it, not a cycle
    graph = {m: [t for t in ts if not _is_package_parent(m, t)] for m, ts in GRAPH.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize("room,forbidden", [
    ("pdtopo.runtime.engine", ("pdtopo.runtime.disagg", "pdtopo.runtime.local",
                               "pdtopo.runtime.api", "pdtopo.runtime.distributed",
                               "pdtopo.runtime.server", "pdtopo.runtime.scheduler_factory",
                               "pdtopo.launcher", "pdtopo.bench")),
    ("pdtopo.launcher", ("pdtopo.runtime",)),
    ("pdtopo.config", ("pdtopo.runtime", "pdtopo.launcher", "pdtopo.bench")),
    ("pdtopo.bench", ("pdtopo.runtime", "pdtopo.launcher", "pdtopo.tune")),
    # the live planner's core is pure: the planner program (launcher) feeds it and acts
    ("pdtopo.planner", ("pdtopo.runtime", "pdtopo.launcher", "pdtopo.tune")),
    # the launcher's sub-packages, one way: plan <- render <- operate <- programs
    ("pdtopo.launcher.plan", ("pdtopo.launcher.render", "pdtopo.launcher.operate",
                              "pdtopo.launcher.programs")),
    ("pdtopo.launcher.render", ("pdtopo.launcher.operate", "pdtopo.launcher.programs")),
    ("pdtopo.launcher.operate", ("pdtopo.launcher.programs",)),
])
def test_rooms_import_only_what_they_may(room, forbidden):
    bad = [(mod, target) for mod, targets in GRAPH.items()
           if mod == room or mod.startswith(room + ".")
           for target in targets if any(target == f or target.startswith(f + ".")
                                        for f in forbidden)]
    assert bad == []


def _room(module: str) -> str:
    """The top-level room of a module: `pdtopo.X` for a module of the package pdtopo/X/."""
    parts = module.split(".")
    room = ".".join(parts[:2])
    return room if any(m.startswith(room + ".") for m in MODULES) else module


def test_no_cycles_between_rooms():
    """Rooms (config, launcher, bench, tune, runtime, ...) import one way: a module-level
    acyclic graph can still loop between packages (a -> b.x, b.y -> a.z)."""
    rooms: dict[str, set[str]] = {}
    for mod, targets in GRAPH.items():
        src = _room(mod)
        rooms.setdefault(src, set()).update(
            _room(t) for t in targets if _room(t) != src and t != "pdtopo")
    assert _cycles({r: sorted(ts) for r, ts in rooms.items()}) == []


def test_only_the_cli_imports_the_launch_job():
    users = sorted(m for m, ts in GRAPH.items() if "pdtopo.launcher.operate.launch" in ts)
    assert users == ["pdtopo.cli"]


def test_launcher_top_level_keeps_at_most_three_modules():
    top = sorted(p.name for p in (PACKAGE / "launcher").glob("*.py"))
    assert len(top) <= 3, top
    assert sorted(p.name for p in (PACKAGE / "launcher").iterdir() if p.is_dir()
                  and p.name != "__pycache__") == ["operate", "plan", "programs", "render"]


DISAGG = "pdtopo.runtime.disagg"


def _within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


@pytest.mark.parametrize("room,may_import", [
    # the transport never imports the roles (prefill, decode, mixin_base, held_budget,
    # observability: whatever of disagg is outside transport/ and reshard/)
    (f"{DISAGG}.transport", (f"{DISAGG}.transport", f"{DISAGG}.reshard")),
    # reshard imports transport at most
    (f"{DISAGG}.reshard", (f"{DISAGG}.reshard", f"{DISAGG}.transport")),
])
def test_disagg_rooms_import_only_what_they_may(room, may_import):
    assert MODULES.get(room, Path()).name == "__init__.py", f"{room} is no package"
    bad = [(mod, target) for mod, targets in GRAPH.items() if _within(mod, room)
           for target in targets if _within(target, DISAGG)
           and not any(_within(target, ok) for ok in may_import)]
    assert bad == []


def test_disagg_roles_sit_above_transport_and_reshard():
    """The roles the transport may not import are there, and import it (the rule above is
    not vacuous)."""
    roles = sorted(m for m in MODULES if m.startswith(DISAGG + ".")
                   and not any(_within(m, f"{DISAGG}.{r}") for r in ("transport", "reshard")))
    assert {f"{DISAGG}.prefill", f"{DISAGG}.decode", f"{DISAGG}.mixin_base"} <= set(roles), roles
    assert any(_within(t, f"{DISAGG}.transport") for t in GRAPH[f"{DISAGG}.mixin_base"])


def test_runtime_top_level_keeps_at_most_four_modules():
    top = sorted(p.name for p in (PACKAGE / "runtime").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 4, top
    # conf/config.yaml's launcher.server_module and `python -m pdtopo.runtime.server` name it
    assert "server.py" in top


def test_type_checking_imports_are_edges(tmp_path):
    """An import only type checkers run still makes the loop: it is read like any other."""
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from pdtopo.tune.outcome import Outcome\n")
    assert ("pdtopo.tune.outcome.Outcome", 3, False) in _imports(src, "pdtopo.tune")


def test_function_level_imports_are_deferred_dependencies_only():
    bad = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for name, line, nested in _imports(path):
            if nested and not _said_deferred(lines, line - 1):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == []


def _said_deferred(lines: list[str], i: int) -> bool:
    """The import at lines[i] carries the comment, or a block of imports / blank lines up to
    a line that does."""
    while i >= 0:
        if DEFERRED in lines[i]:
            return True
        text = lines[i].strip()
        if not (text.startswith(("import ", "from ")) or text == "" or text.endswith(",")
                or text.endswith("(") or text == ")"):
            return False
        i -= 1
    return False


def test_benchmarks_do_not_import_tests():
    bad = [f"{p.name}:{line} {name}" for p in sorted((ROOT / "benchmarks").glob("*.py"))
           for name, line, _ in _imports(p) if name.split(".")[0] == "tests"]
    assert bad == []


def test_the_graph_sees_known_edges():
    """The reader is not blind: edges that must exist are found."""
    assert "pdtopo.runtime.engine.scheduler" in GRAPH["pdtopo.runtime.scheduler_factory"]
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _room("pdtopo.launcher.plan.expand") == "pdtopo.launcher"
    assert _room("pdtopo.cli") == "pdtopo.cli"


MAX_LINES = 600  # past this a module holds two rooms' worth: split it (tests/ are excepted)


def test_no_module_runs_past_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _code_in(path: Path) -> list[str]:
    """The functions and classes defined anywhere in `path` (nested ones and ones under `if`
    or `try` included)."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{n.name} (line {n.lineno})" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def test_package_faces_hold_no_code():
    """A package's `__init__.py` is its face: a docstring and re-exports. A function or class
    belongs in a module whose name says what it is (the face may re-export it)."""
    bad = {str(p.relative_to(ROOT)): found for p in MODULES.values()
           if p.name == "__init__.py" and (found := _code_in(p))}
    assert bad == {}


def test_the_face_rule_sees_code(tmp_path):
    face = tmp_path / "__init__.py"
    face.write_text('"""A face."""\nfrom os import path\n\ntry:\n    async def run():\n'
                    '        pass\nexcept ImportError:\n    class Stub:\n        pass\n')
    assert _code_in(face) == ["run (line 5)", "Stub (line 8)"]
