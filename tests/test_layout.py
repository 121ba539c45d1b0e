"""The package's layout rules, read from its import graph (every import, also those inside
functions): what runs on a worker imports nothing of the driver's, each layer imports only the
layers below it, and no modules import each other in a loop. No Ray, no torch: the files are
parsed, not run."""

import ast
import os

from tests.conftest import REPO

PACKAGE = os.path.join(REPO, "raytrain_app")

# Lowest first. A module imports only from lower layers, or from its own package.
LAYERS = [
    {"errors"},
    {"storage", "console", "rayinternals", "distributed", "waiting", "config"},  # config: the schema, nothing else
    {"rundir", "tracking", "data"},
    {"models", "tasks"},
    {"worker"},  # runs in each Ray Train worker
    {"preflight", "cluster"},
    {"launch"},
    {"driver"},  # runs in the `train` process
    {"inference"},
    {"api"},
    {"cli", "raytrain_app"},
]
WORKER_NEVER = {"driver", "launch", "cluster", "preflight", "inference", "api", "cli"}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from raytrain_app.x import name` counts as
    importing raytrain_app.x.name where that is a module)."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], REPO).replace(os.sep, ".").removesuffix(".__init__")
                modules[dotted] = path
    graph = {}
    for module, path in modules.items():
        graph[module] = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "raytrain_app":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    graph[module].add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[module].update(a.name for a in node.names if a.name.split(".")[0] == "raytrain_app")
    return graph


def part(module: str) -> str:
    """The package (or top-level module) a module belongs to: raytrain_app.worker.loop -> worker."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def layer(module: str) -> int:
    return next(i for i, parts in enumerate(LAYERS) if part(module) in parts)


def test_every_module_has_a_layer():
    unplaced = sorted({part(m) for m in import_graph()} - set().union(*LAYERS))
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_the_worker_imports_nothing_of_the_driver():
    wrong = [(m, t) for m, targets in import_graph().items() if part(m) == "worker"
             for t in targets if part(t) in WORKER_NEVER]
    assert not wrong, wrong


def test_each_layer_imports_only_the_layers_below_it():
    upward = [(m, t) for m, targets in import_graph().items() for t in targets
              if part(t) != part(m) and layer(t) >= layer(m)]
    assert not upward, upward


def test_no_modules_import_each_other_in_a_loop():
    graph = import_graph()
    loops, done = [], set()

    def visit(module, path):
        if module in path:
            loops.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            if target != module:
                visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not loops, loops
