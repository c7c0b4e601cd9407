"""The import graph of the package and of the benchmarks: no circles, no upward imports, and
``bench/`` builds on the package and ``tiny_models``, never on ``tests/``.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``: a circle
that only a type checker walks is still a circle for a reader."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS = (
    "__main__",
    "server",
    "topology",
    "edge",
    "assembly",
    "protocols",
    "backends",
    "encoder_tasks",
    "loading",
    "sentence",
    "observability",
    "cli",
    "generation",
    "tasks",
    "model_facts",
    "pod",
    "errors",
    "devices",
    "heap",
    "units",
    "",  # the package itself (its version)
)
"""``huggingfaceserver``'s parts, top to bottom: each imports only those below it."""


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path) -> Iterator[str]:
    """The absolute names of every module or member ``name`` imports."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def graph(package: str) -> dict[str, set[str]]:
    """Each module's imports of other modules of ``package``."""
    found = modules(package)
    return {
        name: {target for target in imports(name, path) if target in found and target != name}
        for name, path in found.items()
    }


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while (member := stack.pop()) != node:
                part.append(member)
            if part:
                found.append(sorted([node, *part]))

    for node in edges:
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", ["huggingfaceserver", "bench"])
def test_no_import_circles(package: str) -> None:
    assert circles(graph(package)) == []


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_part_of_the_package_imports_only_those_below_it() -> None:
    assert {layer(name) for name in modules("huggingfaceserver")} <= set(LAYERS)
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph("huggingfaceserver").items()
        for target in targets
        if LAYERS.index(layer(target)) < LAYERS.index(layer(source))
    )
    assert upward == []


def test_the_benchmarks_do_not_import_the_tests() -> None:
    reaching = sorted(
        f"{name} -> {target}"
        for name, path in modules("bench").items()
        for target in imports(name, path)
        if target == "tests" or target.startswith("tests.")
    )
    assert reaching == []


def test_the_checks_see_a_circle_and_an_upward_import() -> None:
    """The checks themselves: a made-up graph with both faults."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert LAYERS.index(layer("huggingfaceserver.errors")) > LAYERS.index(layer("x.backends.y"))
