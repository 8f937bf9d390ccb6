"""The house, floor by floor: imports only point down, and no two modules import each other.

Every module of `engine/`, `workbench/` and `apps/` is parsed with `ast`; every import counts,
including imports inside functions (the ones that hide a cycle) and the lazy public names of a
package's `_EXPORTS` table. A module may import its own floor or any floor below it; an import
that points up a floor fails, and so does any cycle of imports between modules (on any floors).

The floors are data (`FLOORS`, bottom first; the same map as docs/architecture.md's "Architecture map"). A new
module belongs to the floor of the longest prefix that names it; a new package that no prefix names
fails `test_every_module_has_a_floor` until it is given one here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "workbench", "apps")

# bottom first; a module may import from its own floor and the floors below it
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # the one source of truth and plain per-sequence data; nothing here builds a model
    # errors and user files opened with size limits: what every other module may use
    ("engine base", ("engine.errors", "engine.io", "engine.lazy", "engine.heap")),
    ("engine config", ("engine.config", "engine.config_io", "engine.presets", "engine.io.inputs", "engine.runtime",
                       "engine.probes", "engine.hooks", "engine.cache", "engine.tokenizer", "engine.deployment",
                       "engine.builtin", "engine.model_ref", "engine.model_card", "engine.session.chat_response", "engine.interventions")),
    # who this rank is, the one choke point for collectives, expert placement maths
    ("engine parallel", ("engine.parallel",)),
    # one folder per operator: reference.py (pure torch) beside triton_*.py
    ("engine ops", ("engine.ops",)),
    # the layers wire projections, caches and collectives to the ops (the vision tower is layers the model calls)
    ("engine layers", ("engine.layers", "engine.vision")),
    ("engine model", ("engine.model", "engine.numerics", "engine.decode")),
    # the checkpoint: tensor table, shard slices, files, loading that builds a model, counts and plans from the table
    ("engine weights", ("engine.weights",)),
    # per-sequence running: prefill/decode, sampling, snapshots (file I/O), batches
    ("engine session", ("engine.session",)),
    # the `hf` extra: transformers / nnsight / ContextCite interfaces over the model, its loader and tokenizer
    ("engine hf", ("engine.hf",)),
    # the package's lazy public names (`from engine import load_model, Session`)
    ("engine package", ("engine",)),
    # filler, task text and pictures for experiments (nothing below them in workbench)
    ("workbench text", ("workbench.text", "workbench.retrieval_text", "workbench.pictures", "workbench.shape_pictures",
                        "workbench.task_templates")),
    # the settings a trace's tables carry (trace format): below the store that writes them and the analysis that reads them
    ("workbench trace format", ("workbench.recorded_settings",)),
    # pure functions over trace arrays (and the recorded settings tables carry); they never open a trace
    ("workbench analysis", ("workbench.analysis",)),
    # the trace store and the signal families, whose tables the store reads and writes
    ("workbench trace", ("workbench.trace", "workbench.signals")),
    # the views' reducers over a trace (the dashboard's and `workbench.show`'s numbers; no Panel)
    ("workbench views", ("workbench.analysis.views",)),
    # probe sinks: reduce engine signals into trace rows
    ("workbench recorders", ("workbench.recorders", "workbench.captures")),
    # the public API: `workbench.record`, `open_trace`, `recorded_session`
    ("workbench package", ("workbench", "workbench.sessions", "workbench.compare", "workbench.questions", "workbench.inline",
                           "workbench.interventions", "workbench.causal_effects",
                           "workbench.attribution", "workbench.causal", "workbench.span_attribution",
                           "workbench.__main__", "workbench.conversation_trace", "workbench.conformance", "workbench.toolkit")),
    # who may talk to a local web server (Host / Origin), shared by the dashboard and `workbench serve`
    ("apps web guard", ("apps.web_guard",)),
    # the follower and the frame every view draws; below the components that watch it
    ("apps dashboard state", ("apps.dashboard.follower",)),
    ("apps dashboard components", ("apps.dashboard.components",)),
    # composition, serving, the view registry, drive mode
    ("apps dashboard", ("apps.dashboard",)),
    # `workbench serve`: the OpenAI-compatible endpoint (it reuses the dashboard's Host/Origin policy)
    ("apps serve", ("apps.serve",)),
    # the top floor: the command line wires engine, workbench and dashboard together
    ("apps cli", ("apps", "apps.cli")),
]
# the package roots name only themselves: their submodules need floors of their own
ROOTS = {"engine", "workbench", "apps"}

# (importer, imported) pairs allowed to point up, each with the reason
EXEMPT = {
    # `python -m workbench` / `torchrun -m workbench` must keep working while the command line lives
    # on the top floor: the thin entry script is the one module of `workbench` that imports `apps`
    ("workbench.__main__", "apps.cli"): "entry script of the command line",
}


def module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = module_files()


def _resolve(name: str) -> str | None:
    """The project module an import of `name` loads (`pkg.mod.attr` -> `pkg.mod`), or None if external."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """Project modules `module` imports anywhere in its body (functions included)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import mod` imports the submodule; `from mod import name` the module
            names += [f"{prefix}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS"
                                                  for t in node.targets):
            # a package's lazy public names: `{"load_model": "engine.weights.load", ...}`
            if isinstance(node.value, ast.Dict):
                names += [v.value for v in node.value.values
                          if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    found = {_resolve(n) for n in names}
    return {m for m in found if m is not None and m != module}


GRAPH = {m: imports_of(m) for m in MODULES}


def floor_of(module: str) -> int | None:
    """Index in FLOORS of the longest prefix naming `module` (a root names only itself)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if p in ROOTS and module != p:
                continue
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def test_every_module_has_a_floor() -> None:
    missing = sorted(m for m in MODULES if floor_of(m) is None)
    assert not missing, f"modules without a floor (add their package to FLOORS in {__file__}): {missing}"


def test_imports_only_point_down() -> None:
    upward = []
    for module, deps in sorted(GRAPH.items()):
        mine = floor_of(module)
        for dep in sorted(deps):
            theirs = floor_of(dep)
            if mine is None or theirs is None or theirs <= mine or (module, dep) in EXEMPT:
                continue
            upward.append(f"{module} ({FLOORS[mine][0]}) imports {dep} ({FLOORS[theirs][0]})")
    assert not upward, "imports pointing up a floor:\n  " + "\n  ".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_engine_never_imports_workbench_or_apps_and_workbench_never_imports_apps() -> None:
    bad = [f"{m} imports {d}" for m, deps in sorted(GRAPH.items()) for d in sorted(deps)
           if (m.split(".")[0], d.split(".")[0]) in {("engine", "workbench"), ("engine", "apps"),
                                                     ("workbench", "apps")} and (m, d) not in EXEMPT]
    assert not bad, bad


def test_floors_are_ordered_engine_then_workbench_then_apps() -> None:
    roots = [prefixes[0].split(".")[0] for _, prefixes in FLOORS]
    assert roots == sorted(roots, key=PACKAGES.index), "FLOORS must list engine's floors, then workbench's, then apps'"


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
], ids=["pair", "triangle", "chain"])
def test_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert _cycles(graph) == expected


def test_the_walker_sees_imports_inside_functions() -> None:
    # the session runner imports the workbench only inside functions (so Panel pages start fast)
    assert "workbench.sessions" in GRAPH["apps.dashboard.session_runner"]
    assert "apps.cli" in GRAPH["workbench.__main__"]


def test_the_big_floors_are_split() -> None:
    """An edge that only a folder boundary inside what used to be one floor rules out is caught: the
    pure analysis never opens a trace, the views' reducers sit above the store, the components above
    the follower, and the engine's errors and file limits below its config."""
    assert floor_of("workbench.analysis.dsa") < floor_of("workbench.trace.reader") \
        < floor_of("workbench.analysis.views.base") < floor_of("workbench.recorders.recorder")
    assert floor_of("apps.dashboard.follower") < floor_of("apps.dashboard.components.base") \
        < floor_of("apps.dashboard.views") == floor_of("apps.dashboard.app")
    assert floor_of("engine.errors") < floor_of("engine.config") < floor_of("engine.ops.kda")


# ---- the run core stays the only way in --------------------------------------------------------------
FRONT_DOORS = ("apps",)
# where each piece of the run core lives: nothing else may do it again
ANSWER_LOOP = "engine.session.answer"          # the only `ResponseReader.after`
MODEL_REF = "engine.model_ref"                  # the only reader of `preset:` / `builtin:` prefixes
SESSION_OPENER = "workbench.sessions"           # the only front door to `Session(...)` / `Session.load(...)`
FAMILY_NAMES = {"dsa", "kda", "moe"}


def _calls(module: str) -> list[tuple[str, ast.Call]]:
    """(dotted callee, call) of every call in `module` (`Session`, `ResponseReader.after`, `x.startswith`)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                parts.append(f.id)
            out.append((".".join(reversed(parts)), node))
    return out


def test_only_the_answer_loop_reads_where_an_answer_ends() -> None:
    readers = sorted({m for m in MODULES for callee, _ in _calls(m) if callee.endswith("ResponseReader.after")})
    assert readers == [ANSWER_LOOP], readers


def test_no_front_door_opens_a_session_itself() -> None:
    doors = sorted({m for m in MODULES if m.split(".")[0] in FRONT_DOORS
                    for callee, _ in _calls(m) if callee in ("Session", "Session.load")})
    assert doors == [], f"{doors} open a Session themselves: use {SESSION_OPENER} (recorded_session / open_session)"


def test_model_references_are_parsed_in_one_module() -> None:
    prefixes = ("preset:", "builtin:")
    parsers = sorted({m for m in MODULES for callee, call in _calls(m)
                      if callee.rpartition(".")[2] in ("startswith", "removeprefix", "partition")
                      and any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith(prefixes)
                              for a in call.args)})
    assert parsers == [], f"{parsers} parse model references: use {MODEL_REF}.parse_model_ref"


def test_no_front_door_names_the_signal_families() -> None:
    """A family registered at run time records through every door: none keeps its own list."""
    found = []
    for m in MODULES:
        if m.split(".")[0] not in FRONT_DOORS:
            continue
        for node in ast.walk(ast.parse(MODULES[m].read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(words) >= 2 and len(words) == len(node.elts) and set(words) <= FAMILY_NAMES:
                    found.append(f"{m}: {words}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = {w.strip() for w in node.value.split(",")}
                if len(names) >= 2 and names <= FAMILY_NAMES:
                    found.append(f"{m}: {node.value!r}")
    assert found == [], found


def test_only_the_session_and_its_recorder_touch_observers() -> None:
    """What a caller knows about a run reaches a recording through the session's events (`annotate`,
    `set_interventions`), never by searching `session.observers` for a recorder."""
    touching = sorted(m for m in MODULES if m.startswith(("engine", "workbench", "apps"))
                      and any(isinstance(node, ast.Attribute) and node.attr == "observers"
                              for node in ast.walk(ast.parse(MODULES[m].read_text(encoding="utf-8")))))
    assert touching == ["engine.session.session", "workbench.recorders.recorder"], touching
