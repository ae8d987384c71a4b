"""The layers of ARCHITECTURE.md import only downward, and no module imports itself in a cycle: every import is
counted, at the top of a module or inside a function (a lazy import hides a cycle from Python, not from this test)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The layers, lowest first: each may import those before it, except the sibling layers named under NOT.
ORDER = [
    "pretrain.core",
    "data_pipeline",
    "pretrain.model",
    "objectives",
    "pretrain.hf",
    "pretrain.train",
    "pretrain.pipeline",
    "pretrain.evaluation",
    "pretrain.cli",
]
NOT = {"pretrain.model": {"data_pipeline"}, "objectives": {"data_pipeline"}}
ALLOWED = {name: set(ORDER[: i + 1]) - NOT.get(name, set()) for i, name in enumerate(ORDER)}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("pretrain", "objectives", "data_pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def layer(module: str) -> str | None:
    return next(
        (name for name in sorted(ALLOWED, key=len, reverse=True) if module == name or module.startswith(name + ".")),
        None,
    )


def imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (a package import counts as its __init__)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {t for t in map(resolve, targets) if t and t != name}
        graph[name] = found
    return graph


def test_every_module_has_a_layer_and_imports_only_downward():
    graph = imports()
    assert all(layer(m) for m in graph if m not in ("pretrain",)), [m for m in graph if not layer(m)]
    upward = []
    for module, targets in graph.items():
        own = layer(module)
        if own is None:
            continue
        upward += [f"{module} -> {t}" for t in targets if layer(t) not in ALLOWED[own] and t != "pretrain"]
    assert upward == []


def test_no_import_cycles():
    graph = imports()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []
