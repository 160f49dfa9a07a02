"""The package's shape: imports point down the documented layers (ARCHITECTURE.md, "Package
map"), and there are no import cycles among engramrt's modules (function-level imports count
too: a module that needs its own caller belongs elsewhere). Imports under ``TYPE_CHECKING`` are
type hints, not dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

import engramrt

ROOT = Path(engramrt.__file__).parent


def module_name(path: Path) -> str:
    parts = ["engramrt", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}

    def owner(name: str) -> str | None:  # the module that defines ``name`` (or its package)
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for name in names:
                target = owner(name) if name.startswith("engramrt") else None
                # a package's __init__ importing its own submodules is not a cycle
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


# The documented layers, top to bottom: a module imports only from its own layer's packages
# and the layers below. ``engramrt/__init__`` re-exports the public names and stands outside.
LAYERS = [
    ["engramrt.__main__", "engramrt.cli"],
    ["engramrt.commands"],
    ["engramrt.server", "engramrt.bundled"],
    ["engramrt.engine"],
    ["engramrt.parallel"],
    ["engramrt.runner"],
    ["engramrt.prompts"],
    # generic checkpoint loading reads a config through the family registry
    ["engramrt.model.checkpoint"],
    ["engramrt.models"],
    ["engramrt.model"],
    ["engramrt.engram"],
    ["engramrt.kernels"],
    [
        "engramrt.config",
        "engramrt.config_base",
        "engramrt.models.deepseek_v41.config",
        "engramrt.transfer",
        "engramrt.tensor_parallel",
    ],
]


def layer_of(module: str) -> int:
    for i, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return i
    raise AssertionError(f"{module} is in no documented layer (tests/test_architecture.py)")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (a, b)
        for a, targets in graph.items()
        if a != "engramrt"
        for b in targets
        if layer_of(b) < layer_of(a)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_checker_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "engramrt.runner.stage" in graph and graph["engramrt.runner.stage"]
    assert cycles(graph) == []


def test_imports_point_down_the_layers() -> None:
    graph = import_graph()
    assert upward_imports(graph) == []
    # the checker sees a planted upward import, and skips type-only ones
    planted = {**graph, "engramrt.kernels.tiles": {"engramrt.runner.stage"}}
    assert upward_imports(planted) == [("engramrt.kernels.tiles", "engramrt.runner.stage")]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engramrt.cli\n"
    found = [n for n in runtime_nodes(ast.parse(src)) if isinstance(n, ast.Import)]
    assert [a.name for n in found for a in n.names] == []
    assert "engramrt.model.mhc" in graph and "engramrt.tensor_parallel" in graph


def test_tests_mirror_the_package() -> None:
    """A folder of tests is named for the package it tests (helpers live in tests/support)."""
    tests = Path(__file__).parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert folders - {"support"} <= packages, folders - {"support"} - packages
    assert len(folders) > 5


FAMILIES = ROOT / "models"
REGISTRY = "engramrt.models"


def family_of(module: str) -> str | None:
    """The family package a module belongs to (``engramrt.models.<family>``), if any."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 2 and parts[1] == "models" else None


def family_leaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a family's modules from outside that family (the registry excepted)."""
    return sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if family_of(b) and a != REGISTRY and family_of(a) != family_of(b)
    )


def test_only_the_registry_imports_a_family() -> None:
    """The engine, runner, commands and bundled code see a family only as ``cfg.family``; a
    family does not reach into another."""
    graph = import_graph()
    families = {p.name for p in FAMILIES.iterdir() if (p / "__init__.py").is_file()}
    assert {"gqa", "deepseek_v41"} <= families
    assert family_leaks(graph) == []
    # the checker sees a planted leak, and lets the registry and a family's own imports pass
    planted = {
        **graph,
        "engramrt.runner.stage": {"engramrt.models.deepseek_v41.moe"},
        "engramrt.models.gqa": {"engramrt.models.gqa.ffn"},
    }
    assert family_leaks(planted) == [("engramrt.runner.stage", "engramrt.models.deepseek_v41.moe")]


def test_no_v41_reads_outside_its_package() -> None:
    """No ``.v41`` attribute read outside the V4.1 package: a family's branch lives in its
    package, never behind a flag read elsewhere (vLLM's ``is_v32``)."""
    own = FAMILIES / "deepseek_v41"
    found = []
    for path in ROOT.rglob("*.py"):
        if own in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "v41":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .v41")
    assert found == []
