"""The package's layering, checked on its source: no import cycle, nothing imports upward.

Every module of ``torchtitan_wlb`` is parsed with ``ast`` (nothing is imported), and every import
statement in it -- module level, inside functions, under ``TYPE_CHECKING`` -- becomes an edge of the
import graph. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg`` (its ``__init__``). The rooms and what each may import are the table below; the layers are
described in docs/architecture.md.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = "torchtitan_wlb"
SOURCE = Path(__file__).resolve().parents[1] / PACKAGE

# Module (or package) -> room; a module belongs to the room of its longest listed prefix.
ROOMS = {
    PACKAGE: "root",  # the package __init__ only
    f"{PACKAGE}.cost_model": "cost_model",
    f"{PACKAGE}.cost_fit": "cost_model",
    f"{PACKAGE}.workloads": "workloads",
    f"{PACKAGE}.models.catalogue": "catalogue",
    f"{PACKAGE}.packing": "packing",
    f"{PACKAGE}.config": "config",
    f"{PACKAGE}.data": "data",
    f"{PACKAGE}.attention": "attention",
    f"{PACKAGE}.cp.plan": "cp.plan",
    f"{PACKAGE}.cp.op": "cp.op",
    f"{PACKAGE}.cp.local": "cp.op",
    f"{PACKAGE}.cp.torch_lb": "cp.op",
    f"{PACKAGE}.cp": "cp",
    f"{PACKAGE}.models": "models",
    f"{PACKAGE}.pipeline": "pipeline",
    f"{PACKAGE}.cpu_support": "platform",
    f"{PACKAGE}.parent_watch": "platform",
    f"{PACKAGE}.device_clock": "platform",
    f"{PACKAGE}.metrics": "trainer",
    f"{PACKAGE}.mfu": "trainer",
    f"{PACKAGE}.log_filter": "trainer",
    f"{PACKAGE}.audit_log": "trainer",
    f"{PACKAGE}.resume": "trainer",
    f"{PACKAGE}.validate": "trainer",
    f"{PACKAGE}.validator": "trainer",
    f"{PACKAGE}.trainer": "trainer",
    f"{PACKAGE}.online_fit": "trainer",
    f"{PACKAGE}.audit_hooks": "trainer",
    f"{PACKAGE}.checkpoint": "trainer",
    f"{PACKAGE}.run_messages": "trainer",
    f"{PACKAGE}.train_spec": "trainer",
    f"{PACKAGE}.train": "trainer",
    f"{PACKAGE}.tools": "tools",
    f"{PACKAGE}.sim": "sim",
}

# Room -> the other rooms its modules may import. Bottom up: the cost model, then packing (pure
# NumPy) and the data nodes; attention kernels, the CP plan (pure NumPy), the CP op with its tensor
# adapters ("cp.op"), adaptive selection with its profile ("cp"), then the model; the pipeline; the
# trainer; tools and the simulator on top, neither importing the other. config holds the [wlb]
# section and takes its accepted values from the registries below it; "platform" (cpu_support,
# parent_watch, device_clock) makes TorchTitan run on CPU, stops orphans and times the device, and
# imports nothing of the package. A new module needs a room here.
_CP = {"attention", "cp.plan", "cp.op", "cp"}
_BELOW_PIPELINE = {
    "platform",
    "cost_model",
    "workloads",
    "catalogue",
    "packing",
    "config",
    "data",
    "models",
} | _CP
ALLOWED = {
    "root": set(),
    "platform": set(),
    "cost_model": set(),
    "workloads": set(),
    "catalogue": set(),
    "packing": {"cost_model"},
    "attention": set(),
    "cp.plan": set(),
    "cp.op": {"attention", "cp.plan"},
    "cp": {"attention", "cp.plan"},
    "config": {"cost_model", "packing", "attention", "cp.plan", "cp"},
    "data": {"cost_model", "packing", "config"},
    "models": {"platform", "cost_model", "catalogue", "config"} | _CP,
    "pipeline": _BELOW_PIPELINE,
    "trainer": _BELOW_PIPELINE | {"pipeline"},
    "tools": _BELOW_PIPELINE | {"pipeline", "trainer"},
    "sim": _BELOW_PIPELINE | {"pipeline", "trainer"},
}

# Modules that must not import torch, directly or through the package modules they import.
TORCH_FREE_PREFIXES = (
    f"{PACKAGE}.cp.plan",
    f"{PACKAGE}.packing",
    f"{PACKAGE}.cost_model",
    f"{PACKAGE}.cost_fit",
)
TORCH_NAMES = {"torch", "torchtitan", "torchdata"}


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the package (``__init__`` = the package)."""
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


@cache
def imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """``(package modules, outside top-level names)`` that ``module`` imports anywhere in it."""
    path = modules()[module]
    return parse_imports(module, path.read_text(), path.name == "__init__.py", set(modules()))


def parse_imports(
    module: str, source: str, is_package: bool, known: set[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """``(package modules, outside top-level names)`` imported by ``source`` (module ``module``);
    ``known``: the package's modules."""
    top = module.split(".")[0]
    inside, outside = set(), set()

    def add(name: str) -> None:
        if name.split(".")[0] == top:
            while name not in known and "." in name:  # longest prefix that is a module
                name = name.rsplit(".", 1)[0]
            inside.add(name)
        else:
            outside.add(name.split(".")[0])

    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                add(sub if sub in known else origin)
    inside.discard(module)
    return frozenset(inside), frozenset(outside)


def room(module: str) -> str:
    name = module
    while name not in ROOMS:
        if "." not in name:
            raise AssertionError(f"module {module} is in no room: add it to ROOMS")
        name = name.rsplit(".", 1)[0]
    if name == PACKAGE and module != PACKAGE:
        raise AssertionError(f"module {module} is in no room: add it to ROOMS")
    return ROOMS[name]


def graph() -> dict[str, set[str]]:
    """Import edges between package modules."""
    return {m: set(imports(m)[0]) for m in modules()}


def find_cycle(edges: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]`` (among ``within`` if given), or ``None``
    (iterative depth-first search)."""
    nodes = set(edges) if within is None else within
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def successors(node: str):
        return iter(sorted(edges.get(node, set()) & nodes))

    for start in sorted(nodes):
        if start in state:
            continue
        path, stack = [start], [successors(start)]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(successors(nxt))
    return None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each group of mutually importing modules (strongly connected
    component), so that a failure names every circle at once."""
    reach = {}
    for node in edges:  # modules reachable from each one (the graph has ~100 nodes)
        seen, todo = set(), [node]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[node] = seen
    found, covered = [], set()
    for node in sorted(edges):
        if node in covered or node not in reach[node]:
            continue
        component = {m for m in reach[node] if node in reach.get(m, ())}
        covered |= component
        found.append(find_cycle(edges, component))
    return found


def test_every_module_has_a_room_with_a_rule():
    for module in modules():
        assert room(module) in ALLOWED, f"room {room(module)!r} of {module} has no ALLOWED entry"


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_nothing_imports_upward():
    bad = []
    for module, targets in sorted(graph().items()):
        for target in sorted(targets):
            here, there = room(module), room(target)
            if here != there and there not in ALLOWED[here]:
                bad.append(f"{module} ({here}) imports {target} ({there})")
            if target.endswith(".__main__"):
                bad.append(f"{module} imports the command-line module {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function in ``source`` longer than ``limit`` lines, from its
    ``def`` (decorators excluded) to its last line, nested functions counted on their own too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append((node.name, length))
    return found


def test_no_function_is_longer_than_the_limit():
    """A function that does not fit a screen does more than one thing: split it."""
    bad = [
        f"{path.relative_to(SOURCE.parent)}: {name} has {length} lines"
        for path in modules().values()
        for name, length in long_functions(path.read_text())
    ]
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(bad)


def test_long_functions_counts_from_def_to_last_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    assert long_functions(f"def short():\n{body[: body.index('x79')]}") == []
    assert long_functions(f"@decorated\ndef long():\n{body}") == [("long", 81)]


@pytest.mark.parametrize("prefix", TORCH_FREE_PREFIXES)
def test_pure_modules_import_no_torch(prefix):
    checked = [m for m in modules() if m == prefix or m.startswith(prefix + ".")]
    assert checked, f"no module matches {prefix}"
    edges = graph()
    for module in checked:
        seen, todo = {module}, [module]
        while todo:  # the module and every package module it imports, transitively
            current = todo.pop()
            found = imports(current)[1] & TORCH_NAMES
            assert not found, f"{module} imports {sorted(found)} (in {current})"
            for target in edges[current] - seen:
                seen.add(target)
                todo.append(target)


def test_graph_helpers_see_the_import_forms():
    """The parser resolves the import forms the package uses (guards the checks above)."""
    known = {"p", "p.a", "p.a.b", "p.c", "p.d"}
    source = (
        "import numpy.linalg\n"
        "from p.a import b, name\n"  # a submodule and a name of p.a
        "from . import d\n"
        "def f():\n"
        "    import torch.distributed\n"
        "    from .a.b import x\n"
        "if TYPE_CHECKING:\n"
        "    from p.c import T\n"
    )
    inside, outside = parse_imports("p.c", source, False, known)
    assert inside == {"p.a", "p.a.b", "p.d"} and outside == {"numpy", "torch"}
    inside, _ = parse_imports("p", "from .a import b\nimport p.c\n", True, known)
    assert inside == {"p.a.b", "p.c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    two = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}
    assert cycles(two) == [["a", "b", "a"], ["c", "d", "c"]]
