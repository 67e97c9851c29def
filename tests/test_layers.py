"""The import graph of src/blocklab, read with `ast` from every import statement anywhere in a file (module level,
inside functions, under TYPE_CHECKING): it has no cycle, and no module imports one on a layer above its own.
A new module must be given a layer in LAYERS, or the last test fails."""
import ast
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom-up. A module takes the layer of the longest prefix listed for it; it may import its own layer or lower.
LAYERS = {
    # 0: what everything may use: registries, errors, the config schema and where the config lives, hardware and
    # network probes, start-up timing, a job's name (which overrides name it), checkpoint reading, plain metrics.
    "blocklab": 0, "blocklab.registry": 0, "blocklab.errors": 0, "blocklab.hardware": 0, "blocklab.paths": 0,
    "blocklab.startup": 0, "blocklab.schema": 0, "blocklab.net": 0, "blocklab.naming": 0, "blocklab.checkpoint": 0,
    "blocklab.analysis.metrics": 0,
    # 1: the model, its components and its config.
    "blocklab.model": 1,
    # 2: the tasks, and the analyses that probe a model on a task's batches.
    "blocklab.tasks": 2, "blocklab.analysis": 2,
    # 3: one experiment: its setup, its results.json contract, the command line's overrides.
    "blocklab.experiment": 3, "blocklab.results": 3, "blocklab.overrides": 3, "blocklab.modifications": 3,
    "blocklab.optim": 3,
    # 4: training, a run and a sweep.
    "blocklab.train": 4,
    # 5: what reads runs and sweeps, or times them.
    "blocklab.report": 5, "blocklab.bench": 5, "blocklab.analyze": 5, "blocklab.generate": 5,
    # 6: the entry points: the Hydra app (and `python -m blocklab.train`, which starts it), the Python API, and
    # `python -m blocklab.decide` (it launches sweeps and judges them).
    "blocklab.cli": 6, "blocklab.train.__main__": 6, "blocklab.api": 6, "blocklab.decide": 6,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "blocklab").rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The blocklab modules this one imports, by any import statement anywhere in it. `from blocklab.x import y`
    counts blocklab.x.y where that is a module, else blocklab.x; `from blocklab import x` counts blocklab.x or
    the package itself."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int:
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)
    if prefix is None:
        raise KeyError(name)
    return LAYERS[prefix]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a cycle or several."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_counts_every_import_statement():
    """Lazy imports inside functions and imports under TYPE_CHECKING are edges too (the CLI imports a run only
    inside its Hydra main; the transformer names its config for type checkers only)."""
    edges = graph()
    assert "blocklab.train.run" in edges["blocklab.cli"]
    assert "blocklab.model.config" in edges["blocklab.model.transformer"]
    assert "blocklab" in edges["blocklab.train.sweep"]  # `from blocklab import study_folder`: the package itself


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_every_module_has_a_layer():
    unplaced = []
    for name in graph():
        try:
            layer(name)
        except KeyError:
            unplaced.append(name)
    assert unplaced == [], "give these modules a layer in LAYERS"


@pytest.mark.parametrize("name", sorted(graph()))
def test_no_module_imports_one_on_a_higher_layer(name):
    upward = sorted(target for target in graph()[name] if layer(target) > layer(name))
    assert upward == [], f"{name} (layer {layer(name)}) imports " + ", ".join(f"{t} (layer {layer(t)})" for t in upward)
