"""kvsched's modules import each other one way only, and the runtime (the
engine and the server) never imports the planner (capacity, the simulator).

Every module of the package is parsed with `ast` (no import runs, so this needs
no JAX): imports at module level and inside functions alike, since an import
hidden in a function is still a dependency, only a deferred one. The edges
between modules of the package form a graph that must have no cycle; a failure
names the cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "kvsched"
ROOT = Path(__file__).resolve().parent.parent / "python" / "kvsched"
RUNTIME = ("kvsched.engine", "kvsched.serve")
PLANNER = ("kvsched.capacity", "kvsched.sim", "kvsched.maxrate_result", "kvsched.cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` lands in: itself, or for `pkg.module.attr` the
    longest prefix that is a module. None outside the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` imports the submodule sub when there is one,
            # else a name defined by pkg itself.
            names = [
                f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            found = visit(node)
            if found:
                return found
    return None


def test_package_imports_have_no_cycle():
    graph = import_graph()
    assert len(graph) > 40, f"found too few modules under {ROOT}: {sorted(graph)}"
    assert "kvsched.engine.runner" in graph and "kvsched.serve.server" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "kvsched modules import each other in a circle: " + " -> ".join(
        cycle or []
    )


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def in_part(module: str, parts: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in parts)


def test_the_runtime_never_imports_the_planner():
    """The engine and the server share shapes and arithmetic with the capacity
    model and the simulator through kvsched.shapes; none of them reaches, even
    through another module, the planner's code (pricing, the simulator)."""
    graph = import_graph()
    runtime = [m for m in graph if in_part(m, RUNTIME)]
    assert len(runtime) > 20
    for module in runtime:
        planner = sorted(m for m in reachable(graph, module) if in_part(m, PLANNER))
        assert not planner, f"{module} imports the planner: {planner}"


def test_the_planner_check_sees_an_indirect_import():
    graph = {"kvsched.engine.a": {"kvsched.shapes"}, "kvsched.shapes": {"kvsched.sim.x"}}
    assert "kvsched.sim.x" in reachable(graph, "kvsched.engine.a")
    assert in_part("kvsched.sim.x", PLANNER) and not in_part("kvsched.simple", PLANNER)


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a2"}, "a2": set(), "b": {"b"}}, True),
    ],
)
def test_find_cycle(graph, has_cycle):
    cycle = find_cycle(graph)
    assert (cycle is not None) == has_cycle
    if cycle:
        assert cycle[0] == cycle[-1]
        assert all(b in graph[a] for a, b in zip(cycle, cycle[1:], strict=False))


def test_function_level_and_relative_imports_count(tmp_path):
    """An import inside a function is an edge too (the circles this test guards
    against were hidden that way), and so is a relative one."""
    modules = {f"kvsched.engine.{m}": tmp_path / f"{m}.py" for m in ("a", "b", "c", "d")}
    src = (
        "import numpy\n"
        "from .c import x\n"
        "def f():\n"
        "    from kvsched.engine.b import thing\n"
        "    import kvsched.engine.d\n"
    )
    modules["kvsched.engine.a"].write_text(src)
    got = _imports("kvsched.engine.a", modules["kvsched.engine.a"], modules)
    assert got == {"kvsched.engine.b", "kvsched.engine.c", "kvsched.engine.d"}
