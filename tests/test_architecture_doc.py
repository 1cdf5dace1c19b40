"""docs/architecture.md is the map: it names every module of the four folders (by its path, or by its
file name in the row of its folder) and every C source, so a module added without a home fails here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["protocol", "frontend", "engine_core", "worker"]


def test_the_architecture_map_names_every_module_and_c_source():
    text = (ROOT / "docs" / "architecture.md").read_text()
    lines = text.splitlines()
    files = [p for package in PACKAGES for p in (ROOT / "coreserve" / package).rglob("*.py") if p.name != "__init__.py"]
    files += list((ROOT / "coreserve" / "worker" / "cpu" / "csrc").glob("*.c"))
    missing = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        in_folder_row = any(folder in line and f"`{path.name}`" in line for line in lines)
        if relative not in text and not in_folder_row:
            missing.append(relative)
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_the_map_answers_where_each_kind_of_change_goes():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for kind in ("A new model family", "A new quantized type", "A new HTTP dialect or endpoint", "A new control verb",
                 "A new sampling feature", "A new backend"):
        assert f"**{kind}**" in text, kind
