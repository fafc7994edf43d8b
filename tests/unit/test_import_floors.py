"""The handler's floors: its top-level parts import one another without a circle, and config imports
only types.

A part is a subpackage (`handler/caches/`, `handler/engine/`, ...) or a top-level module
(`handler/config.py`, `handler/types.py`, ...). Part a imports part b when any module of a imports
any module of b, anywhere in it (inside a function too: a lazy import is still a dependency). Without
a circle the parts stand on floors: floor 0 imports no other part, and each part imports only parts on
floors below its own. On failure the message draws the floors, and names each edge that runs back up
with the files that make it: cutting those edges leaves no circle.
"""

from __future__ import annotations

import ast
import pathlib

HANDLER = pathlib.Path(__file__).resolve().parents[2] / "handler"

Graph = dict[str, set[str]]
Edge = tuple[str, str]


def part_of(module: str) -> str | None:
    """The top-level part of a handler module's dotted name ("handler.caches.kv_cache" -> "caches")."""
    names = module.split(".")
    return names[1] if names[0] == "handler" and len(names) > 1 else None


def imported_modules(path: pathlib.Path) -> set[str]:
    """The dotted names of the handler modules (or packages) that `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "handler":  # `from handler import runners` imports the part itself
                found.update(f"handler.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
    return {name for name in found if part_of(name) is not None}


def part_graph(root: pathlib.Path = HANDLER) -> tuple[Graph, dict[Edge, list[str]]]:
    """Each part's imported parts, and for each edge the files that make it."""
    graph: Graph = {}
    files: dict[Edge, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts == ("__init__.py",):
            continue  # the package's marker, not a part
        part = relative.parts[0].removesuffix(".py")
        graph.setdefault(part, set())
        for target in {part_of(name) for name in imported_modules(path)} - {part}:
            graph[part].add(target)
            files.setdefault((part, target), []).append(f"handler/{relative.as_posix()}")
    return graph, files


def reachable(graph: Graph, start: str) -> set[str]:
    """The parts `start` imports, directly or through others."""
    seen, stack = set(), [start]
    while stack:
        for target in graph.get(stack.pop(), ()):
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def circles(graph: Graph) -> list[set[str]]:
    """The groups of parts that import each other in a circle (strongly connected, more than one part)."""
    reach = {part: reachable(graph, part) for part in graph}
    groups, placed = [], set()
    for part in sorted(graph):
        group = {part} | {other for other in reach[part] if part in reach[other]}
        if len(group) > 1 and part not in placed:
            groups.append(group)
            placed |= group
    return groups


def floors(graph: Graph) -> dict[str, int]:
    """Each part's floor: 0 for a part that imports none, else one above the highest part it imports.
    The parts of a circle share one floor, so that a drawing can still be made of a graph with one."""
    group_of = {part: frozenset({part}) for part in graph}
    for group in circles(graph):
        for part in group:
            group_of[part] = frozenset(group)
    floor_of: dict[frozenset, int] = {}

    def floor(group: frozenset) -> int:
        if group not in floor_of:
            below = {group_of[target] for part in group for target in graph[part]} - {group}
            floor_of[group] = 1 + max((floor(other) for other in below), default=-1)
        return floor_of[group]

    return {part: floor(group_of[part]) for part in graph}


def without(graph: Graph, edges: list[Edge]) -> Graph:
    return {part: {target for target in targets if (part, target) not in edges} for part, targets in graph.items()}


def upward_edges(graph: Graph) -> list[Edge]:
    """Edges whose cut leaves no circle, chosen one at a time: the edge whose cut leaves the fewest parts
    on a circle, then the lowest floors (the cut of a correct edge lifts every part above its target)."""
    cut: list[Edge] = []
    while groups := circles(without(graph, cut)):
        remaining = without(graph, cut)
        inside = [(part, target) for group in groups for part in sorted(group) for target in sorted(remaining[part])]
        inside = [(part, target) for part, target in inside if any({part, target} <= group for group in groups)]

        def cost(edge: Edge) -> tuple[int, int]:
            trial = without(graph, [*cut, edge])
            return sum(len(group) for group in circles(trial)), sum(floors(trial).values())

        cut.append(min(inside, key=cost))
    return cut


def drawing(graph: Graph, files: dict[Edge, list[str]], wrong: list[Edge]) -> str:
    """The floors, lowest first, of the graph without the wrong edges; then the wrong edges."""
    floor = floors(without(graph, wrong))
    lines = ["The handler's floors, lowest first (each part imports only parts on floors below it):"]
    for level in range(max(floor.values()) + 1):
        lines.append(f"  floor {level}: {', '.join(sorted(part for part in floor if floor[part] == level))}")
    for part, target in wrong:
        lines.append(
            f"Offending edge: {part} (floor {floor[part]}) imports {target} (floor {floor[target]}), "
            f"in {', '.join(files[part, target])}"
        )
    return "\n".join(lines)


def test_the_parts_import_without_a_circle():
    graph, files = part_graph()
    wrong = upward_edges(graph)
    assert not wrong, "import edges run back up a floor.\n" + drawing(graph, files, wrong)


def test_config_imports_only_types():
    graph, files = part_graph()
    wrong = sorted(("config", target) for target in graph["config"] - {"types"})
    assert not wrong, "config may import handler.types only.\n" + drawing(graph, files, wrong)


def test_the_drawing_names_a_planted_upward_import(tmp_path):
    """The check has power: a copy of the handler where the KV cache imports the engine fails it, and
    the message names that edge and its file, not one of the engine's own downward imports."""
    copy = tmp_path / "handler"
    for path in HANDLER.rglob("*.py"):
        target = copy / path.relative_to(HANDLER)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    kv_cache = copy / "caches" / "kv_cache.py"
    kv_cache.write_text(kv_cache.read_text(encoding="utf-8") + "\nfrom handler.engine import SpeculativeEngine\n")
    graph, files = part_graph(copy)
    wrong = upward_edges(graph)
    assert wrong == [("caches", "engine")]
    message = drawing(graph, files, wrong)
    assert "Offending edge: caches (floor" in message and "handler/caches/kv_cache.py" in message
