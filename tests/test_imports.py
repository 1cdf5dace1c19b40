"""Imports run one way: frontend -> protocol <- engine_core -> worker (module-level imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["protocol", "frontend", "engine_core", "worker"]
ALLOWED = {
    "protocol": {"protocol"},
    "frontend": {"frontend", "protocol"},
    "engine_core": {"engine_core", "protocol", "worker"},
    "worker": {"worker", "protocol"},
}
# The core reaches the model only through worker/executor.py; torch stays below it.
NEVER_AT_MODULE_LEVEL = {"protocol": {"torch"}, "frontend": {"torch"}, "engine_core": {"torch"}}


def module_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    for path in (ROOT / package).rglob("*.py"):
        project = module_level_imports(path) & set(PACKAGES)
        assert project <= ALLOWED[package], (
            f"{path.relative_to(ROOT)} imports {sorted(project - ALLOWED[package])}"
        )
        assert not module_level_imports(path) & NEVER_AT_MODULE_LEVEL.get(package, set()), path


def test_only_the_in_process_client_reaches_into_the_core_and_nothing_pickles():
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            imports = all_imports(path)
            assert not imports & {"pickle", "cloudpickle", "dill"}, path
            assert "recv_pyobj" not in path.read_text() and "send_pyobj" not in path.read_text()
            if package == "frontend" and "engine_core" in imports:
                assert path.name == "inproc_client.py", path
