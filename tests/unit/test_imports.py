"""No import cycle among the handler's modules, counting the imports inside functions too: a module
that imports another lazily still depends on it, and a lazy cycle hides a seam that is not there.
And every module imports alone: a cycle that breaks at import time, or a module that leans on
another having been imported first, fails there."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

HANDLER = pathlib.Path(__file__).resolve().parents[2] / "handler"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(HANDLER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The handler modules `path` imports anywhere in it (an imported name that is a module counts as one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("handler"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found - {module_name(path)}


def test_the_handler_has_no_import_cycle():
    paths = sorted(HANDLER.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imports_of(path, modules) for path in paths}
    # A package's __init__ that re-exports its modules is not a cycle with them: drop edges into a package
    # from its own modules.
    for name, targets in graph.items():
        graph[name] = {target for target in targets if not name.startswith(target + ".")}
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


# Imports each handler module with no other handler module loaded, in one fresh interpreter: the
# third-party packages stay loaded between imports (a torch import per module would cost minutes).
_IMPORT_EACH_ALONE = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [key for key in sys.modules if key == "handler" or key.startswith("handler.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=-3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_handler_module_imports_alone():
    names = sorted(module_name(path) for path in HANDLER.rglob("*.py"))
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_ALONE, *names],
        cwd=HANDLER.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"modules that fail to import alone:\n{done.stdout}{done.stderr}"
