"""The layout's rules, read off the import graph (AST), so later work keeps them.

docs/DESIGN.md draws the same table. An import inside a function counts; one
under ``if TYPE_CHECKING:`` does not (it never runs).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "elastic_train"
ROOT = "elastic_train"

#: What each part may import besides itself. The top-level modules are parts of their own.
BASE = {"elastic_train", "errors", "log", "metrics"}
ALLOWED: dict[str, set[str]] = {
    "elastic_train": set(),
    "errors": set(),
    "log": set(),
    "metrics": set(),
    "audit": set(),
    "config": {"errors"},
    "etcd": BASE,
    "rendezvous": BASE | {"etcd"},
    "agent": BASE | {"state"},  # the persister writes checkpoints from snapshots
    "workload": BASE | {"config"},
    "state": BASE | {"config"},
    "training": BASE | {"audit", "config", "workload", "state", "etcd"},
    "local": BASE | {"audit", "config", "etcd", "agent", "training", "state"},
    "main": BASE | {"config", "agent", "training"},
    "api": BASE | {"config", "main", "training", "workload"},
    "launch": BASE | {"etcd", "main"},
    "cli": BASE | {"agent", "config", "launch", "local", "state"},  # state: export
    "torchrun_plugin": BASE | {"agent", "rendezvous"},
}
#: The bottom of the system: nothing of the trainer stack, not even transitively.
LOW_LAYERS = {"etcd", "rendezvous"}
HIGH_LAYERS = {"agent", "training", "state", "workload", "local"}
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text())


def _type_checking_nodes(module: ast.Module) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = modules()[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(module: str) -> Iterator[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import that runs."""
    skipped = _type_checking_nodes(tree(module))
    for node in ast.walk(tree(module)):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield (submodule, []) if submodule in modules() else (target, [alias.name])


@cache
def graph() -> dict[str, set[str]]:
    """Our modules and the modules of ours each one imports."""
    return {m: {t for t, _ in imports(m) if t in modules() and t != m} - {m} for m in modules()}


def part(module: str) -> str:
    """``elastic_train.etcd.client`` -> ``etcd``; ``elastic_train.cli`` -> ``cli``."""
    return module.split(".")[1] if "." in module else module


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for target in graph()[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_every_part_is_in_the_table() -> None:
    assert {part(m) for m in modules()} == set(ALLOWED)


def test_imports_go_downward_only() -> None:
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in graph().items()
        for t in targets
        if part(t) != part(m) and part(t) not in ALLOWED[part(m)]
    )
    assert not wrong, "imports against the layering (docs/DESIGN.md):\n" + "\n".join(wrong)


@pytest.mark.parametrize("low", sorted(LOW_LAYERS))
def test_the_rendezvous_layers_import_nothing_of_the_trainer_stack(low: str) -> None:
    reached = {
        f"{m} -> ... -> {t}"
        for m in modules()
        if part(m) == low
        for t in closure(m)
        if part(t) in HIGH_LAYERS
    }
    assert not reached, "\n".join(sorted(reached))


def test_no_import_cycles() -> None:
    cycles = [scc for scc in _strongly_connected(graph()) if len(scc) > 1]
    assert not cycles, f"import cycles: {cycles}"


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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
                found.append(sorted(component))
    return found


def test_no_module_is_over_500_lines() -> None:
    long = {
        m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_config_does_not_import_torch() -> None:
    config = [m for m in modules() if part(m) == "config"]
    heavy = {
        f"{m} imports {t}"
        for m in {*config, *(c for m in config for c in closure(m))}
        for t, _ in imports(m)
        if t.split(".")[0] == "torch"
    }
    assert not heavy, heavy


def _defined(module: str) -> set[str]:
    names = set()
    for node in tree(module).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _all(module: str) -> list[str]:
    for node in tree(module).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            return list(ast.literal_eval(node.value))
    return []


def test_no_re_exports_between_modules() -> None:
    """A name is imported from the module that defines it, never through another one:
    in the package, the tests, the benchmarks and the examples."""
    users = {m: modules()[m] for m in modules()}
    for folder in ("tests", "benchmarks", "examples"):
        for path in (PACKAGE_DIR.parent / folder).rglob("*.py"):
            users[f"{folder}:{path.name}"] = path
    relayed = sorted(
        f"{user} takes {name} from {t}"
        for user, path in users.items()
        for t, names in _imports_in(path, user)
        if t in modules() and modules()[t].name != "__init__.py"
        for name in names
        if name not in _defined(t)
    )
    declared = sorted(
        f"{m} exports {n}" for m in modules() for n in _all(m) if n not in _defined(m)
    )
    assert not relayed + declared, "\n".join(relayed + declared)


def _imports_in(path: Path, user: str) -> Iterator[tuple[str, list[str]]]:
    if user in modules():
        yield from imports(user)
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield (submodule, []) if submodule in modules() else (node.module, [alias.name])


def test_one_class_per_name() -> None:
    seen: dict[str, list[str]] = {}
    for m in modules():
        for node in tree(m).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(m)
    assert not {n: ms for n, ms in seen.items() if len(ms) > 1}


def test_package_inits_hold_only_a_docstring() -> None:
    """Importing ``elastic_train.etcd.client`` must not import the rest of ``etcd``."""
    busy = [m for m, p in modules().items() if p.name == "__init__.py" and len(tree(m).body) > 1]
    assert busy == ["elastic_train"], busy  # the root holds __version__ too
