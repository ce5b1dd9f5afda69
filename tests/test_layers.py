"""The package's layers, read from the code (an ``ast`` walk over every module, counting
imports inside functions too: they hide a dependency, they don't remove it; ``if
TYPE_CHECKING:`` blocks are left out).

Layers, bottom to top; a module imports only from its own layer or below, and no set of
modules imports each other in a cycle:

0. the instruction set, meshes, grammars, errors, the native module's loader
1. the compiler (pure: capture, propagation, plans, lowering, checks, the interpreter)
2. the runtime (controller, workers, executors, transport)
3. the API (tensors, actors, process meshes, mesh_fn, remote functions, parallel wrappers)
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "monarch_dsl"

LAYERS = [
    ("base", ("isa", "mesh", "grammar", "errors", "frames", "_build", "_core")),
    ("compiler", ("compiler",)),
    ("runtime", ("runtime",)),
    ("api", ("",)),  # everything else
]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = ("monarch_dsl",) + p.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(mod: str) -> set[str]:
    """The package modules ``mod`` imports, anywhere in it."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for sub in node.body for n in ast.walk(sub))
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # ``from pkg import module`` names the module; ``from pkg import name``, pkg
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for name in names:
            if name.startswith("monarch_dsl"):
                target = _resolve(name)
                if target and target != mod:
                    out.add(target)
    return out


def layer_of(mod: str) -> int:
    rest = mod.removeprefix("monarch_dsl").lstrip(".")
    for k, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if p and (rest == p or rest.startswith(p + ".")):
                return k
    return len(LAYERS) - 1


GRAPH = {m: imports_of(m) for m in MODULES}


def test_nothing_imports_upward():
    up = [
        f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
        for m, ts in sorted(GRAPH.items())
        for t in sorted(ts)
        if layer_of(t) > layer_of(m) and t != "monarch_dsl"
    ]
    assert not up, "upward imports:\n" + "\n".join(up)


def test_no_module_imports_the_package_root():
    """The root re-exports the API; a module inside importing it depends on everything."""
    bad = [m for m, ts in GRAPH.items() if "monarch_dsl" in ts and m != "monarch_dsl"]
    bad = [m for m in bad if m != "monarch_dsl.__main__"]
    assert not bad, bad


def test_the_process_layer_does_not_hold_the_tensor_engine():
    """proc_mesh.py starts and stops processes; the engine registers its hooks on the job.
    (It uses tensor.activation for pm.activate() and pm.rank() only.)"""
    engine = {m for m in MODULES if m.startswith("monarch_dsl.tensor")} - {
        "monarch_dsl.tensor.activation"
    }
    assert not GRAPH["monarch_dsl.proc_mesh"] & engine
    assert not any(
        t.startswith("monarch_dsl.tensor") for t in GRAPH["monarch_dsl.runtime.controller"]
    )


def test_no_import_cycles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_walk_sees_imports_inside_functions():
    """(The check itself: a function-level import counts; the executor imports the plan runner
    only in ``plans()``.)"""
    assert "monarch_dsl.runtime.plan_runner" in GRAPH["monarch_dsl.runtime.executor"]
