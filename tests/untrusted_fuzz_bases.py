"""The valid inputs the untrusted-input fuzzer mutates (tests/untrusted_mutation.py's `Bases`), made once
under a cache folder and reused: a small llama GGUF (tests/gguf_files.py's model with a 512-token vocabulary,
F32 but one Q8_0 tensor, so that dtype "auto" keeps blocks), a PEFT adapter for the built-in tiny model, and
the tiny model's own folder. Runs in the fuzzer's child process (PEFT needs torch).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from untrusted_mutation import Bases

LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def make_bases(cache_dir: Path) -> Bases:
    from coreserve.protocol.builtin_model import builtin_model_path

    tiny = builtin_model_path("tiny")
    gguf = _made(cache_dir / "base.gguf", _write_gguf)
    lora = _made(cache_dir / "adapter", lambda path: _write_adapter(tiny, path))
    return Bases(gguf=str(gguf), hf=tiny, lora=str(lora))


def _made(path: Path, write: Callable[[Path], None]) -> Path:
    """`path`, written by `write` unless there; atomic, so a run cut short leaves no half-made base."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        write(tmp / path.name)
        os.rename(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_gguf(path: Path) -> None:
    from gguf_files import write_gguf_model

    write_gguf_model(path, {"model.layers.0.mlp.down_proj.weight": "Q8_0"}, "F32", vocab_size=512)


def _write_adapter(base: str, path: Path) -> None:
    """PEFT's adapter of rank 2 (alpha 4), random A and B, saved as PEFT saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(path))
