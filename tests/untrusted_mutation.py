"""The vocabulary of the untrusted-input fuzzer (tests/untrusted_fuzz.py): the valid inputs it starts from
(`Bases`), one mutation of one of them (`Mutation`: what it changes, and the function that writes the
mutated copy), and the helpers the mutation modules share: odd values, a folder that links a base's files,
a safetensors file rewritten around a new header, a mutation of the first bases pointed at a hybrid one.

A mutation writes only under the case's own folder; the bases are never changed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

HUGE_INTS = (2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1)
# What a JSON number can be replaced by: extremes, the wrong type, NaN as a float and as a string
ODD_JSON_VALUES = (0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**30, 1.5, -0.0, float("nan"), float("inf"), "NaN", "12",
                   "", True, None, [], [1], {}, {"a": 1})


@dataclass(frozen=True)
class Bases:
    """The valid inputs, made once per run (tests/untrusted_fuzz_child.py's `make_bases`)."""

    gguf: str  # a small llama GGUF file (tests/gguf_files.py's model, a 512-token vocabulary)
    hf: str  # the built-in tiny model's folder: read only, mutations copy or link its files
    lora: str  # a PEFT adapter folder for the tiny model (rank 2: q_proj, v_proj, down_proj)
    # hybrids (tests/untrusted_fuzz_hybrid.py), 2 layers each with the tiny model's GPT-2 tokenizer: a random
    # Qwen3-Next folder (a Gated DeltaNet layer, then full attention; experts and a shared expert), an LFM2
    # folder (a short conv layer, then attention), a Granite 4.0-H folder (a Mamba2 layer, then NoPE attention),
    # and the GGUF file llama.cpp's converter writes of each
    next_hf: str
    next_gguf: str
    lfm2_hf: str
    lfm2_gguf: str
    granite_hf: str
    granite_gguf: str
    # issue 65's (tests/untrusted_fuzz_gpt_oss*.py, untrusted_fuzz_windows*.py, untrusted_fuzz_gemma4.py): 2-layer
    # folders (SmolLM3's 4) with the same tokenizer and, but Gemma 4's, their converted GGUF files: gpt-oss with
    # MXFP4 experts, OLMo 3, SmolLM3, Exaone 4; Gemma 4's text decoder
    gpt_oss_hf: str
    gpt_oss_gguf: str
    olmo3_hf: str
    olmo3_gguf: str
    smollm3_hf: str
    smollm3_gguf: str
    exaone4_hf: str
    exaone4_gguf: str
    gemma4_hf: str


@dataclass(frozen=True)
class Mutation:
    kind: str  # the family of mutation, the report's rows: "gguf-header", "hf-config", "lora", ...
    description: str  # what was changed, enough to redo it by hand
    target: str  # what the child loads from the written path: "model", "lora" or "template"
    make: Callable[[Bases, Path], str]  # writes the mutated input under the folder, returns its path
    # the Bases field it starts from, whose load it is compared with; None: the target's first base (the llama
    # GGUF or the tiny folder, by the written path's suffix; the adapter; the ChatML template)
    base: str | None = None


# a base's mutations' report rows: its group's name, "hybrid" for the hybrids' and Granite's (kind_of)
_KIND_PREFIXES = {"gpt_oss": "gpt-oss", "olmo3": "windows", "smollm3": "windows", "exaone4": "windows",
                  "gemma4": "gemma4"}


def kind_of(base: str, part: str) -> str:
    """The report's kind of a mutation of part `part` ("config", "safetensors", "gguf", "tensors") made from the
    Bases field `base` (its name less `_hf` / `_gguf`)."""
    return f"{_KIND_PREFIXES.get(base.rsplit('_', 1)[0], 'hybrid')}-{part}"


def on_base(mutation: Mutation, base: str, kind: str, label: str) -> Mutation:
    """`mutation`, written for the llama GGUF or the tiny folder, made from the hybrid base `base` instead
    (the Bases field that the mutation's own helpers read is pointed at it) and compared with its load."""
    slot = "gguf" if base.endswith("_gguf") else "hf"
    make = mutation.make

    def make_on(bases: Bases, folder: Path) -> str:
        return make(replace(bases, **{slot: getattr(bases, base)}), folder)

    return replace(mutation, kind=kind, description=f"{label}: {mutation.description}", make=make_on, base=base)


def linked_copy(source: str, folder: Path, replaced: dict[str, bytes | None]) -> Path:
    """`folder` holding a link to each file of `source`, except `replaced`'s names: written with their
    bytes, or left out (None). Links keep the tiny model's 114 MB of weights off the disk."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in Path(source).iterdir():
        if item.name not in replaced:
            os.symlink(item.resolve(), folder / item.name)
    for name, data in replaced.items():
        if data is not None:
            (folder / name).write_bytes(data)
    return folder


def json_bytes(value: object) -> bytes:
    """JSON as Python writes it: NaN and Infinity are written bare, as some exporters do."""
    return json.dumps(value, indent=1).encode()


def safetensors_parts(path: str) -> tuple[dict, int]:
    """A valid safetensors file's header (a dict) and where its data section starts."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def rewrite_safetensors(source: str, destination: Path, header: bytes | dict, header_len: int | None = None,
                        patches: dict[int, bytes] | None = None) -> None:
    """`source`'s data section behind a new header (raw bytes, or a dict to write as JSON); `header_len`:
    the length field when it should lie; `patches`: bytes to overwrite at offsets of the data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    _, data_start = safetensors_parts(source)
    with open(source, "rb") as src, open(destination, "wb") as dst:
        dst.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw)
        src.seek(data_start)
        shutil.copyfileobj(src, dst, 16 << 20)
        for offset, data in (patches or {}).items():
            dst.seek(8 + len(raw) + offset)
            dst.write(data)


def float_bytes(value: float, dtype: str) -> bytes:
    """One value in a safetensors dtype's bytes (F32, F16, BF16)."""
    if dtype == "BF16":
        return struct.pack("<f", value)[2:]
    return struct.pack({"F32": "<f", "F16": "<e", "F64": "<d"}[dtype], value)
