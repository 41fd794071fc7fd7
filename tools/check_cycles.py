"""Fail when the project's modules import each other in a cycle (``make lint``).

import-linter's layer contract (pyproject ``[tool.importlinter]``) keeps imports pointing down the
layers; this check covers what it does not: a cycle between two files of one layer, counting
imports inside functions too (grimp reads every import statement of a module).
"""

from __future__ import annotations

import sys

import grimp

PACKAGES = ("cdc", "sinks", "snapshot", "spark_jobs")


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def main() -> int:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    found = cycles(graph)
    for component in found:
        print("import cycle: " + " <-> ".join(component))
        for module in component:
            for other in component:
                if other != module and graph.direct_import_exists(importer=module, imported=other):
                    lines = graph.get_import_details(importer=module, imported=other)
                    where = ", ".join(str(d["line_number"]) for d in lines)
                    print(f"  {module} imports {other} (line {where})")
    if found:
        print(f"{len(found)} import cycle(s); break them (see docs/architecture.md, 'Layers')")
        return 1
    print(f"no import cycles among {len(graph.modules)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
