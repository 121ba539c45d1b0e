"""The package's layout rules, read from its import graph (every import, also those inside
functions, relative ones and those by a name in a string): what runs on a worker imports nothing
of the driver's, each layer imports only the layers below it, and no modules import each other
in a loop. No Ray, no torch: the files are parsed, not run."""

import ast
import functools
import os
import re

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
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
COMMAND = re.compile(r"-m +(raytrain_app(?:\.\w+)+)")  # `python -m MODULE`: a process of its own
NAMED = re.compile(r"\braytrain_app(?:\.\w+)+")  # a module named in a string, to import


@functools.cache
def graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Module -> the package's modules it imports (`from raytrain_app.x import name` counts as
    importing raytrain_app.x.name where that is a module), by import statements, absolute or
    relative, and by name in a string (`importlib.import_module("raytrain_app.x")`, a preload
    list); and module -> the modules it starts as commands in a string (`python -m
    raytrain_app.x`), which run in a process of their own. Docstrings name modules, not imports."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], REPO).replace(os.sep, ".").removesuffix(".__init__")
                modules[dotted] = path
    imports, commands = {}, {}
    for module, path in modules.items():
        imports[module], commands[module] = set(), set()
        tree = ast.parse(open(path).read())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, DOCUMENTED)
                      and node.body and isinstance(node.body[0], ast.Expr)}
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}".rstrip(".")
                if base.split(".")[0] == "raytrain_app":
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        imports[module].add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                imports[module].update(a.name for a in node.names if a.name.split(".")[0] == "raytrain_app")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                commands[module].update(COMMAND.findall(node.value))
                imports[module].update(name for name in NAMED.findall(COMMAND.sub("", node.value)) if name in modules)
    return imports, commands


def import_graph() -> dict[str, set[str]]:
    return graphs()[0]


def part(module: str) -> str:
    """The package (or top-level module) a module belongs to: raytrain_app.worker.loop -> worker."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def layer(module: str) -> int:
    return next(i for i, parts in enumerate(LAYERS) if part(module) in parts)


def test_the_graph_holds_the_packages_imports_of_every_kind():
    """The rules below pass on a graph that misses imports: it holds the package's hundreds, and
    those that only a string names (the modules local mode's fork server preloads); the commands
    named in strings (a submitted job's entry point) are modules that exist."""
    imports, commands = graphs()
    assert sum(len(targets) for targets in imports.values()) >= 300
    assert "raytrain_app.worker.preloaded" in imports["raytrain_app.driver.local"]
    named = {target for targets in commands.values() for target in targets}
    assert named and named <= set(imports), named - set(imports)


def test_every_module_has_a_layer():
    unplaced = sorted({part(m) for m in import_graph()} - set().union(*LAYERS))
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_the_worker_imports_nothing_of_the_driver():
    """Nor starts any of its commands."""
    imports, commands = graphs()
    wrong = [(m, t) for m in imports if part(m) == "worker"
             for t in imports[m] | commands[m] if part(t) in WORKER_NEVER]
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
