"""Print the import graph of django_dbworker, by layer unit, and its cycles.

    python scripts/import_graph.py [--runtime]

Built with grimp (what import-linter uses), so function-level imports count.
Units: top-level modules; worker.* one per module; admin, db, management,
contrib and migrations collapsed. ``--runtime`` leaves out imports under
``if TYPE_CHECKING:``, as the import contracts in pyproject.toml do. For the
closing notes of layering changes ("graph before and after").
"""

from __future__ import annotations

import sys

import grimp

COLLAPSE = {"admin", "db", "management", "contrib", "migrations"}


def unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if parts[1] in COLLAPSE:
        return parts[1] + "/"
    return ".".join(parts[1:])


def cycles(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    graph = grimp.build_graph(
        "django_dbworker",
        include_external_packages=False,
        exclude_type_checking_imports="--runtime" in sys.argv,
        cache_dir=None,
    )
    unit_edges: dict[str, set[str]] = {}
    module_edges: dict[str, set[str]] = {}
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            module_edges.setdefault(module, set()).add(imported)
            a, b = unit(module), unit(imported)
            if a != b:
                unit_edges.setdefault(a, set()).add(b)
    print("## unit -> imports")
    for a in sorted(unit_edges):
        print(f"{a} -> {', '.join(sorted(unit_edges[a]))}")
    units = {unit(m) for m in graph.modules} - {"__init__"}
    # The package __init__ only re-exports the public API; leave it out of unit cycles.
    inner = {a: bs - {"__init__"} for a, bs in unit_edges.items() if a != "__init__"}
    print("## unit cycles (excluding __init__ re-exports)")
    for component in cycles(units, inner):
        print("  SCC:", " ".join(component))
    print("## module cycles")
    for component in cycles(set(graph.modules), module_edges):
        print("  SCC:", " ".join(m.replace("django_dbworker.", "") for m in component))


if __name__ == "__main__":
    main()
