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
    "pretrain.cli_options",
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


def _functions_with(predicate) -> list[str]:
    """'file:function' (the innermost enclosing function, or <module>) of every AST node in pretrain/, objectives/
    and data_pipeline/ for which predicate(node) holds."""
    found = []

    def walk(node, where, rel):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if predicate(child):
                found.append(f"{rel}:{inner}")
            walk(child, inner, rel)

    for path in modules().values():
        walk(ast.parse(path.read_text()), "<module>", str(path.relative_to(ROOT)))
    return found


def _product_names(node) -> set[str]:
    """The names and attribute names multiplied together in a chain of `*`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _product_names(node.left) | _product_names(node.right)
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return {node.id} if isinstance(node, ast.Name) else set()


def test_the_global_batch_is_formed_in_one_function():
    """micro_batch_size x grad_accum_steps (x ranks) is TrainConfig.global_batch; everyone else calls it."""

    def forms_it(node):
        return isinstance(node, ast.BinOp) and {"micro_batch_size", "grad_accum_steps"} <= _product_names(node)

    assert sorted(set(_functions_with(forms_it))) == ["pretrain/core/config_schema.py:global_batch"]


def _docstrings() -> set[int]:
    ids = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    ids.add((first.value.lineno, first.value.col_offset, first.value.value))
    return ids


def test_the_precision_mode_is_decided_in_one_function():
    """The mode (fp32, bf16-autocast, bf16, fp16) is decided by distributed.run_precision alone: the machine's
    precision is resolved only there, and the name 'bf16-autocast' is written once, as the constant it returns
    (comparisons use the constant). Everything else reads ResolvedRun.precision."""
    docstrings = _docstrings()

    def names_the_mode(node):
        return (
            isinstance(node, ast.Constant)
            and node.value == "bf16-autocast"
            and (node.lineno, node.col_offset, node.value) not in docstrings
        )

    def resolves(node):
        func = node.func if isinstance(node, ast.Call) else None
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in ("resolve_precision", "run_precision")

    assert _functions_with(names_the_mode) == ["pretrain/train/distributed.py:<module>"]
    callers = sorted(set(_functions_with(resolves)))
    assert callers == [
        "pretrain/train/distributed.py:run_precision",  # the machine's precision, resolved once
        "pretrain/train/setup.py:resolve_run",  # the run's mode, held by ResolvedRun
        "pretrain/train/trainer.py:saved_fingerprint",  # an old checkpoint's mode (legacy=True): not this run's
    ]


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_a_screen():
    """A function expresses one idea: none in pretrain/, objectives/ or data_pipeline/ runs over 80 lines (most stay
    under 60). Long ones are split where their steps are, not wrapped."""
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines)")
    assert long == []


def test_test_modules_share_helpers_through_one_module():
    """Tests import shared code from tests/helpers.py (fixtures from conftest.py), never from each other."""
    crossing = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            crossing += [
                f"{path.name} imports {n}" for n in names if n.split(".")[-1].startswith(("test_", "conftest"))
            ]
    assert crossing == []
