"""The import graph of our packages is a DAG: no module imports (at module level or inside a function) a
module that imports it back, directly or through others. Function-level imports count: they hide a cycle from
Python's loader, not from a reader."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("neuron_opt", "models", "kernels_nki")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports; `from a.b import c` is a.b.c when that is a module, else a.b."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t and t not in modules:  # `import a.b.c` where only a.b is ours, etc.
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_a_dag():
    modules = our_modules()
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    # a package re-exporting its own modules (eagerly or lazily, as neuron_opt/__init__ does for LLM) is not a
    # cycle: those edges go from the package to its descendants, and a module reaching its own package for such a
    # name does not close a loop through other modules
    for m, p in modules.items():
        if p.name == "__init__.py":
            graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    found = cycles(graph)
    detail = "\n".join(" <-> ".join(c) + ": " + "; ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c)
                       for c in found)
    assert not found, f"import cycles:\n{detail}"


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def package_of(module: str) -> str:
    """The unit a package-level tie is between: a subpackage of neuron_opt (neuron_opt.parallel), a top-level
    module of it (neuron_opt.config), or a top-level package (models, kernels_nki)."""
    parts = module.split(".")
    if parts[0] != "neuron_opt":
        return parts[0]
    return ".".join(parts[:2])


def package_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (the root package's lazy re-exports excluded)."""
    graph: dict[str, set[str]] = {}
    for m, p in modules.items():
        if m == "neuron_opt":
            continue
        src = package_of(m)
        graph.setdefault(src, set())
        for t in imports_of(m, p, modules):
            dst = package_of(t)
            if t != "neuron_opt" and dst != src:
                graph[src].add(dst)
                graph.setdefault(dst, set())
    return graph


def test_packages_depend_one_way():
    """No two packages import each other, directly or through others (models -> config, never back)."""
    graph = package_graph(our_modules())
    found = cycles(graph)
    detail = "\n".join(" <-> ".join(c) + ": " + "; ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c)
                       for c in found)
    assert not found, f"package cycles:\n{detail}"


def test_the_package_check_sees_a_tie_both_ways(tmp_path):
    modules = {"neuron_opt.a.x": tmp_path / "x.py", "neuron_opt.b": tmp_path / "b.py"}
    (tmp_path / "x.py").write_text("from neuron_opt.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from neuron_opt.a.x import g\n")
    assert cycles(package_graph(modules)) == [["neuron_opt.a", "neuron_opt.b"]]
