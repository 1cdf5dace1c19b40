"""The built wheel holds the whole package and nothing beside it: every package and module under
coreserve/ (pyproject.toml finds them; a hand-kept list once left two out), the C sources the kernels
build from, `coreserve` as the only top-level name, and the `coreserve` command. The wheel is built
once, as `pip install .` builds it, from a copy of the working tree (a stale build/ in the checkout would
add modules since removed) and without the prebuilt kernels (CORESERVE_KERNEL_VARIANTS=none: compiling
them takes minutes; scripts/wheel_smoke.sh installs the full wheel and serves from it)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "coreserve"
# What a checkout may hold that is not source: caches, builds, the prebuilt kernels (setup.py's own)
NOT_SOURCE = ("__pycache__", "*.pyc", "prebuilt", "*.egg-info", "build", "dist", ".venv", ".git", "*_cache")


def copy_working_tree(target: Path) -> None:
    """The checkout's files that git does not ignore (tracked, and new ones not yet added) into target;
    without git, the tree less NOT_SOURCE. What .gitignore names stays out: a bench_out/ of model files
    (gigabytes) would otherwise be copied for every run of the suite."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:
        shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = ROOT / name
        if path.is_file() and not {"__pycache__", "prebuilt"} & set(Path(name).parts):  # a deleted file: gone
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / name, follow_symlinks=False)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    copy_working_tree(source)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
               "-w", str(tmp / "out")]
    done = subprocess.run(command, env={**os.environ, "CORESERVE_KERNEL_VARIANTS": "none"}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    [built] = (tmp / "out").glob("coreserve-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def source_files(pattern: str, folder: Path = PACKAGE) -> set[str]:
    """The checkout's files under folder matching pattern, as paths in a wheel (caches left out)."""
    return {
        path.relative_to(ROOT).as_posix() for path in folder.rglob(pattern)
        if path.is_file() and not {"__pycache__", "prebuilt"} & set(path.relative_to(ROOT).parts)
    }


def test_every_package_and_module_of_the_checkout_is_in_the_wheel(wheel_names):
    modules = source_files("*.py")
    packages = {path.rsplit("/", 1)[0] for path in modules if path.endswith("/__init__.py")}
    assert len(packages) > 10 and "coreserve/frontend/server/parsers" in packages  # the walk found them
    assert sorted(modules - set(wheel_names)) == []
    # a folder of modules without __init__.py would be no package, and packages.find would leave it out
    assert sorted({path.rsplit("/", 1)[0] for path in modules} - packages) == []


def test_the_c_sources_are_in_the_wheel(wheel_names):
    sources = source_files("*", PACKAGE / "worker" / "cpu" / "csrc")
    assert any(path.endswith(".c") for path in sources) and any(path.endswith(".h") for path in sources)
    assert sorted(sources - set(wheel_names)) == []


def test_coreserve_is_the_only_top_level_name(wheel_names):
    tops = {name.split("/", 1)[0] for name in wheel_names}
    [info] = [top for top in tops if top.endswith(".dist-info")]
    assert info.startswith("coreserve-") and tops == {"coreserve", info}


def test_the_coreserve_command_is_the_cli_main(wheel, wheel_names):
    [entry_points] = [name for name in wheel_names if name.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    with zipfile.ZipFile(wheel) as archive:
        parser.read_string(archive.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {"coreserve": "coreserve.frontend.cli:main"}
