"""The import graph's rules: imports run one way, frontend -> protocol <- engine_core -> worker
(module-level imports); no two modules import each other, even through a chain or inside a function,
nor two sub-packages (coreserve.worker.models, coreserve.worker.parallel) through any of their modules;
the core enters coreserve/worker/ through one module; no module imports another's private names; no socket
path pickles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "coreserve"  # the one top-level package; the four roles are its folders
PACKAGES = ["protocol", "frontend", "engine_core", "worker"]
ALLOWED = {
    "protocol": {"protocol"},
    "frontend": {"frontend", "protocol"},
    "engine_core": {"engine_core", "protocol", "worker"},
    "worker": {"worker", "protocol"},
}
# The core reaches the model only through coreserve/worker/executor.py; torch stays below it.
CORE_ENTRY = "coreserve.worker.executor"
NEVER_AT_MODULE_LEVEL = {"protocol": {"torch"}, "frontend": {"torch"}, "engine_core": {"torch"}}
# Protocol modules the core and the worker share and the frontend does not: the worker may not import the
# core, and the core enters the worker through CORE_ENTRY alone, so coreserve/protocol/ is the one place
# both may import (the step contracts also travel as they are to tensor-parallel rank processes)
CORE_AND_WORKER = {"coreserve.protocol.step", "coreserve.protocol.prompt_lookup"}


def role(name: str) -> str:
    """The role folder a dotted name lies in (coreserve.worker.x -> worker), or its top name (torch)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "coreserve" and len(parts) > 1 else parts[0]


def module_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {role(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(role(node.module))
    return names


def all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {role(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(role(node.module))
    return names


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (PKG / package).rglob("*.py")}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere (module level or inside a function): for
    `from a.b import c`, a.b.c where c is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name in modules:
                    found.add(name)
                elif node.module in modules:
                    found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node], _ = 2, path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The sub-packages (coreserve.worker.models, coreserve.worker.parallel, coreserve.frontend.clients ...) and the sub-packages
    their modules import, at module level or inside a function, but for their own ancestors and
    descendants: a package's own modules (coreserve/worker/model_runner.py, coreserve/worker/backend.py) are the
    ground its sub-packages stand on, or the top that puts them together."""
    modules = project_modules()

    def package(name: str) -> str | None:
        is_package = name in modules and modules[name].name == "__init__.py"
        owner = name if is_package else name.rpartition(".")[0]
        return owner if owner.count(".") >= 2 else None  # coreserve.worker, coreserve.frontend: the one-way rule's

    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    packages: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if (source := package(name)) is not None:
            packages.setdefault(source, set()).update(
                target for t in targets if (target := package(t)) is not None and not related(source, target)
            )
    return packages


def protocol_users(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each protocol module and the roles whose modules import it, directly or through other protocol
    modules (coreserve.protocol.arrays serves whoever imports coreserve.protocol.messages)."""
    users: dict[str, set[str]] = {name: set() for name in graph if role(name) == "protocol"}
    for name, targets in graph.items():
        for target in targets & users.keys():
            users[target] |= {role(name)} - {"protocol"}
    is_growing = True
    while is_growing:  # until every protocol module holds the roles of the protocol modules that import it
        is_growing = False
        for name in users:
            for target in graph[name] & users.keys():
                is_growing |= not users[name] <= users[target]
                users[target] |= users[name]
    return users


def one_sided(users: dict[str, set[str]]) -> dict[str, list[str]]:
    return {name: sorted(roles) for name, roles in users.items()
            if name not in CORE_AND_WORKER and not ("frontend" in roles and roles & {"engine_core", "worker"})}


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    for path in (PKG / package).rglob("*.py"):
        project = module_level_imports(path) & set(PACKAGES)
        assert project <= ALLOWED[package], (
            f"{path.relative_to(ROOT)} imports {sorted(project - ALLOWED[package])}"
        )
        assert not module_level_imports(path) & NEVER_AT_MODULE_LEVEL.get(package, set()), path


def test_no_module_imports_itself_through_others_even_inside_a_function():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The checker itself, on a hand-made graph: a -> b -> c -> a (the test above must be able to fail)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from coreserve.worker.executor import Executor\n")
    assert imported_modules(probe, project_modules()) == {"coreserve.worker.executor"}


def test_no_two_sub_packages_import_each_other_even_through_others():
    """coreserve.worker.models -> coreserve.worker.parallel -> coreserve.worker.models is a cycle even where no module imports itself:
    a sub-package's modules may use another's only where that one never needs it back."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_the_package_check_finds_a_cycle_no_module_check_sees():
    """Two sub-packages that use each other through different modules: no module cycle, a package one."""
    graph = {
        "coreserve.worker.models.loader": {"coreserve.worker.parallel.sharding"},
        "coreserve.worker.parallel.sharding": {"coreserve.worker.models.config"},
        "coreserve.worker.models.config": set(),
        "coreserve.worker.model_runner": {"coreserve.worker.models.loader", "coreserve.worker.parallel.sharding"},
    }
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["coreserve.worker.models", "coreserve.worker.parallel", "coreserve.worker.models"]


# Sub-packages that must not import another even where no cycle would follow: LoRA reaches the C kernels
# only through the backend it is handed (coreserve/worker/backend.py's lora_products).
NEVER_IMPORTS = {"coreserve.worker.lora": "coreserve.worker.cpu"}


def test_lora_imports_nothing_of_the_cpu_backend():
    packages = package_graph(import_graph())
    for source, banned in NEVER_IMPORTS.items():
        assert banned not in packages.get(source, set()), f"{source} imports {banned}"


def test_the_banned_import_check_sees_one_inside_a_function(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from coreserve.worker.cpu.bindings import LoraGroup\n")
    graph = {"coreserve.worker.lora.probe": imported_modules(probe, project_modules())}
    assert package_graph(graph) == {"coreserve.worker.lora": {"coreserve.worker.cpu"}}


def test_the_core_enters_worker_through_one_module():
    graph = import_graph()
    entries = {
        target
        for name, targets in graph.items()
        if name.startswith("coreserve.engine_core")
        for target in targets
        if target.startswith("coreserve.worker")
    }
    assert entries == {CORE_ENTRY}, f"coreserve/engine_core/ imports {sorted(entries)} of coreserve/worker/"


def test_no_module_imports_a_private_name_of_another():
    modules = project_modules()
    offenders = []
    for folder in [*PACKAGES, "scripts", "tests", "examples"]:
        for path in (PKG / folder if folder in PACKAGES else ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and role(node.module) in PACKAGES:
                    private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
                    offenders += [f"{path.relative_to(ROOT)}: {node.module}.{name}" for name in private]
                elif isinstance(node, ast.Import):
                    offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names
                                  if a.name in modules and any(p.startswith("_") for p in a.name.split("."))]
    assert not offenders, offenders


def test_nothing_asks_an_executor_or_runner_what_it_can_do():
    """One control shape: the Executor protocol's verbs, called, never probed with hasattr."""
    for package in ("engine_core", "worker"):
        for path in (PKG / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr":
                    subject = ast.unparse(node.args[0])
                    assert "executor" not in subject and "runner" not in subject, (path, subject)


def test_nothing_reaches_into_a_runners_private_members():
    """A draft model runs its own runner as a step does, through `prepare` and `forward_and_sample`."""
    for package in ("engine_core", "worker"):
        for path in (PKG / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    subject = ast.unparse(node.value)
                    assert "runner" not in subject, (str(path.relative_to(ROOT)), f"{subject}.{node.attr}")


def test_only_the_in_process_client_reaches_into_the_core_and_nothing_pickles():
    for package in PACKAGES:
        for path in (PKG / package).rglob("*.py"):
            imports = all_imports(path)
            assert not imports & {"pickle", "cloudpickle", "dill"}, path
            assert "recv_pyobj" not in path.read_text() and "send_pyobj" not in path.read_text()
            if package == "frontend" and "engine_core" in imports:
                assert path.name == "inproc_client.py", path


def test_protocol_holds_only_what_the_frontend_and_the_core_both_use():
    """A protocol module that only the frontend, or only the core (engine_core and worker: one process),
    imports belongs in that side's folder. The in-process client counts as the frontend: it lives there and
    runs in the user's process. CORE_AND_WORKER is exempt (see its comment), while both its roles use it."""
    users = protocol_users(import_graph())
    assert not one_sided(users), f"used by one side only, move them there: {one_sided(users)}"
    assert all({"engine_core", "worker"} <= users[name] for name in CORE_AND_WORKER), CORE_AND_WORKER


def test_the_side_check_follows_protocol_modules_and_finds_a_one_sided_one():
    graph = {
        "coreserve.frontend.a": {"coreserve.protocol.messages"},
        "coreserve.engine_core.b": {"coreserve.protocol.messages", "coreserve.protocol.events"},
        "coreserve.protocol.messages": {"coreserve.protocol.arrays"},
        "coreserve.protocol.arrays": set(),
        "coreserve.protocol.events": set(),
    }
    users = protocol_users(graph)
    assert users["coreserve.protocol.arrays"] == {"frontend", "engine_core"}
    assert one_sided(users) == {"coreserve.protocol.events": ["engine_core"]}
