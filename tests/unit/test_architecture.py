"""The package graph, read from the source with ast: no import cycle between moezero's packages, the
layering the design promises, and only the public API of zero/ used outside it."""

import ast
import dataclasses
import importlib
import os
from typing import Dict, Iterator, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO_INTERNALS = {"engine", "inner", "master", "families"}  # attributes only zero/ may touch
FORBIDDEN = {
    ("moezero.training", "moezero.compression"),  # QAT plugs into training from above
    ("moezero.compression", "moezero.training"),
    ("moezero.models", "moezero.parallel"),  # the model knows no parallel layout
    ("moezero.checkpoint", "moezero.training"),
}


def _sources(*folders) -> Iterator[Tuple[str, ast.Module]]:
    for folder in folders:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path) as f:
                        yield os.path.relpath(path, REPO), ast.parse(f.read(), path)


def _imported_modules(tree: ast.Module) -> Iterator[str]:
    """Absolute names of the moezero modules a file imports ('from moezero import x' -> moezero.x)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("moezero"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moezero"):
            yield node.module
            if node.module == "moezero":
                yield from (f"moezero.{a.name}" for a in node.names)


def _package(module: str) -> str:
    """The graph node: moezero.<first part> (a package, or a top-level module such as moezero.config)."""
    return ".".join(module.split(".")[:2])


def _package_of_file(path: str) -> str:
    return _package(os.path.splitext(path)[0].replace(os.sep, ".").removesuffix(".__init__"))


def _graph() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for path, tree in _sources("moezero"):
        source = _package_of_file(path)
        for module in _imported_modules(tree):
            target = _package(module)
            if target not in (source, "moezero"):
                graph.setdefault(source, set()).add(target)
    return graph


def _cycle(graph: Dict[str, Set[str]]):
    """One cycle as a list of nodes, or None."""
    state: Dict[str, int] = {}  # 1: on the stack, 2: done
    stack = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_imports():
    for path, _ in _sources("moezero"):
        importlib.import_module(os.path.splitext(path)[0].replace(os.sep, ".").removesuffix(".__init__"))


def test_no_import_cycle_between_packages():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def _module_of_file(path: str) -> str:
    return os.path.splitext(path)[0].replace(os.sep, ".").removesuffix(".__init__")


def _module_level_imports(tree: ast.Module) -> Iterator[ast.AST]:
    """The imports that run when the module loads, and those under `if TYPE_CHECKING:` (a type hint's import
    is a dependency for a reader and a type checker all the same); not those inside a function."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _module_graph() -> Dict[str, Set[str]]:
    """moezero's modules and the modules each imports at module level (`from moezero.zero import engine` and
    `from moezero.zero.engine import ZeroEngine` both name moezero.zero.engine; `from moezero.zero import
    ZeroOptimizer` names the package's __init__)."""
    sources = {_module_of_file(path): tree for path, tree in _sources("moezero")}
    graph: Dict[str, Set[str]] = {}
    for module, tree in sources.items():
        for node in _module_level_imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                assert not node.level, f"{module}:{node.lineno} imports relatively (moezero's imports are absolute)"
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in sources else node.module
                    for a in node.names
                ]
            graph.setdefault(module, set()).update(t for t in targets if t in sources and t != module)
    return graph


def test_no_import_cycle_between_modules():
    """No module imports itself through others at module level, type-hint imports included (a circle of
    modules is one concept spread over files: each needs the others to be read). Break one by moving what both
    need below both, or by passing an object in."""
    graph = _module_graph()
    assert "moezero.zero.engine" in graph["moezero.zero.optimizer"]  # the graph itself
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_layering():
    graph = _graph()
    broken = [(a, b) for a, b in FORBIDDEN if b in graph.get(a, ())]
    assert not broken, broken


def test_only_the_public_api_of_zero_is_used_outside_it():
    for path, tree in _sources("moezero", "tools", "examples_moe"):
        if path.startswith(os.path.join("moezero", "zero")):
            continue
        for module in _imported_modules(tree):
            assert not module.startswith("moezero.zero."), f"{path} imports {module}: use moezero.zero"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ZERO_INTERNALS:
                raise AssertionError(f"{path}:{node.lineno} reads .{node.attr} (the optimizer's internals)")


PRIVATE_TORCH = {
    "_current_graph_task_id",
    "_execution_engine",
    "_cdata",
    "_parse_to",
    "DisableTorchFunctionSubclass",
    "_dynamo",
}


def test_private_torch_apis_live_in_one_module():
    """torch_internals.py states the torch versions they are tested with; nothing else reaches them."""
    found = [
        f"{path}:{node.lineno} .{node.attr}"
        for path, tree in _sources("moezero")
        if not path.endswith("torch_internals.py")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH
    ]
    assert not found, found
    assert any(path.endswith("torch_internals.py") for path, _ in _sources("moezero"))


def test_the_stage_flag_offers_the_registrys_stages():
    """config.py sits below zero/ and cannot import the registry: the choices are kept equal here."""
    from moezero.config import ZeroConfig
    from moezero.zero.stages import STAGES

    choices = next(f.metadata["choices"] for f in dataclasses.fields(ZeroConfig) if f.name == "stage")
    assert tuple(choices) == tuple(STAGES)


ENGINE_PARTS = {
    "parts",
    "records",
    "reducer",
    "master",
    "gatherer",
    "agreement",
    "stage",
    "families",
    "storages",
    "strategies",
    "inner_state",
}


def test_the_engine_is_a_facade():
    """The optimizer, its state and modify_model talk to ZeroEngine through its methods: no file of zero/ but
    engine.py reaches a part behind it (`opt.engine.reducer...`), and none reaches a private member of another
    object (`opt._outside`), so each part's lifecycle stays with the part that owns it."""
    found = []
    for path, tree in _sources(os.path.join("moezero", "zero")):
        if path.endswith("engine.py"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not isinstance(node.value, ast.Attribute):
                continue
            if node.value.attr == "engine" and (node.attr in ENGINE_PARTS or node.attr.startswith("_")):
                found.append(f"{path}:{node.lineno} engine.{node.attr}")
        for node in ast.walk(tree) if not path.endswith("optimizer.py") else ():  # its own class's module
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id == "opt"
            ):
                found.append(f"{path}:{node.lineno} opt.{node.attr}")
    assert not found, found


NOT_WORKS = {
    "LocalChannel": "a channel: its wait takes a message index",
    "Agreement": "records compared (agreement.py), waited through check()",
}


def test_every_work_in_parallel_answers_the_work_protocol():
    """Whatever transport carries a collective, its launched work answers is_completed() and wait(timeout=None)
    (parallel/work.py), so a caller waits for one without knowing which transport serves the group."""
    import inspect

    works = []
    for path, _ in _sources(os.path.join("moezero", "parallel")):
        module = importlib.import_module(os.path.splitext(path)[0].replace(os.sep, ".").removesuffix(".__init__"))
        for name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__ or not hasattr(cls, "wait"):
                continue
            if name in NOT_WORKS or name == "Work":
                continue
            works.append(name)
            timeout = inspect.signature(cls.wait).parameters.get("timeout")
            assert timeout is not None and timeout.default is None, f"{path}: {name}.wait takes no timeout=None"
            assert list(inspect.signature(cls.is_completed).parameters) == ["self"], f"{path}: {name}.is_completed"
    assert len(works) >= 10, works


def test_one_place_maps_a_group_to_its_transport():
    """comm.py reaches a group's transport only through transport.py (it imports none of the transports' parts),
    and only transport.py keeps a map keyed by process group: a transport is chosen once per group, not picked on
    every call from registries of the transports' modules."""
    parts = {"local_channel", "local_exchange", "peer_exchange", "local_transport"}
    for path, tree in _sources(os.path.join("moezero", "parallel")):
        if path.endswith("comm.py"):
            imported = {
                alias.name.split(".")[-1]
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)
                for alias in node.names
            } | {
                node.module.split(".")[-1]
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module
            }
            assert not imported & parts, f"comm.py imports {sorted(imported & parts)}: ask transport.transport_of"
        if not path.endswith("transport.py") or path.endswith("local_transport.py"):
            registries = [
                node.lineno
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr == "WeakKeyDictionary"
            ]
            assert not registries, f"{path}:{registries[0]} keeps a registry by group: transport.py maps groups"
