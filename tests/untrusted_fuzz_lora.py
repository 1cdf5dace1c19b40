"""LoRA adapter mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py), made from the base PEFT
adapter (rank 2 on the tiny model's q_proj, v_proj and down_proj): adapter_config.json's fields (r,
lora_alpha, the file not an object), and adapter_model.safetensors' tensors (wider than their module, the
wrong rank or number of dims, non-finite values, integer dtypes, unknown modules and layers) and header.
`catalog()` is the named list; `drawn` a random one from a seeded generator.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from untrusted_mutation import ODD_JSON_VALUES, Bases, Mutation, json_bytes, linked_copy, rewrite_safetensors

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers.0."
Q_A, Q_B = PREFIX + "self_attn.q_proj.lora_A.weight", PREFIX + "self_attn.q_proj.lora_B.weight"  # [2, 256], [256, 2]


def config_mutation(description: str, edit: Callable[[dict], object] | bytes | None) -> Mutation:
    def make(bases: Bases, folder: Path) -> str:
        if edit is None or isinstance(edit, bytes):
            data = edit
        else:
            data = json_bytes(edit(json.loads((Path(bases.lora) / CONFIG).read_text())))
        return str(linked_copy(bases.lora, folder / "adapter", {CONFIG: data}))

    return Mutation("lora", f"{CONFIG}: {description}", "lora", make)


def set_keys(**values: object) -> Mutation:
    shown = ", ".join(f"{k} = {v!r}" for k, v in values.items())
    return config_mutation(shown, lambda config: {**config, **values})


def tensors_mutation(description: str, edit: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> Mutation:
    """adapter_model.safetensors rewritten with its tensors edited (numpy arrays by name)."""

    def make(bases: Bases, folder: Path) -> str:
        from safetensors.numpy import load_file, save_file

        tensors = edit(load_file(str(Path(bases.lora) / WEIGHTS)))
        path = linked_copy(bases.lora, folder / "adapter", {WEIGHTS: None})
        save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
        return str(path)

    return Mutation("lora", f"{WEIGHTS}: {description}", "lora", make)


def replaced(key: str, value: Callable[[np.ndarray], np.ndarray], description: str,
             new_key: str | None = None) -> Mutation:
    def edit(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        old = tensors.pop(key)
        return {**tensors, new_key or key: value(old)}

    return tensors_mutation(f"{new_key or key}: {description}", edit)


def _with_value(array: np.ndarray, value: float) -> np.ndarray:
    array = array.copy()
    array.flat[0] = value
    return array


def header_mutation(description: str, header: bytes, header_len: int | None = None) -> Mutation:
    def make(bases: Bases, folder: Path) -> str:
        path = linked_copy(bases.lora, folder / "adapter", {WEIGHTS: None})
        rewrite_safetensors(str(Path(bases.lora) / WEIGHTS), path / WEIGHTS, header, header_len)
        return str(path)

    return Mutation("lora", f"{WEIGHTS}: {description}", "lora", make)


def catalog() -> list[Mutation]:
    mutations = [set_keys(r=v) for v in (0, -1, "8", 2**40, 32, 4, 1.5)]
    mutations += [set_keys(lora_alpha=v) for v in (math.nan, -1, "x", math.inf, 10**400)]
    mutations += [set_keys(use_rslora="yes"), set_keys(target_modules=5), set_keys(peft_type="PREFIX_TUNING"),
                  set_keys(use_dora=True), set_keys(fan_in_fan_out=True), set_keys(rank_pattern={"q_proj": 4}),
                  config_mutation("a list", lambda config: [config]), config_mutation("not JSON", b"{"),
                  config_mutation("missing", None)]
    pad = lambda rows, cols: lambda a: np.zeros((a.shape[0] + rows, a.shape[1] + cols), a.dtype)  # noqa: E731
    mutations += [replaced(Q_B, pad(1, 0), "B [257, 2], wider than q_proj"),
                  replaced(Q_A, pad(0, 1), "A [2, 257], wider than q_proj's input"),
                  replaced(Q_A, pad(1, 0), "A of rank 3"), replaced(Q_A, lambda a: a.reshape(-1), "A one-dimensional"),
                  replaced(Q_A, lambda a: a[..., None], "A three-dimensional"),
                  replaced(Q_A, lambda a: _with_value(a, math.nan), "A[0, 0] = NaN"),
                  replaced(Q_B, lambda a: _with_value(a, math.inf), "B[0, 0] = inf"),
                  replaced(Q_A, lambda a: a.astype(np.int32), "A as int32"),
                  replaced(Q_A, lambda a: a.astype(np.float64), "A as float64"),
                  replaced(Q_A, lambda a: a, "renamed to zz_proj", Q_A.replace("q_proj", "zz_proj")),
                  replaced(Q_A, lambda a: a, "renamed to layer 99", Q_A.replace("layers.0.", "layers.99.")),
                  tensors_mutation(f"{Q_B} dropped", lambda t: {k: v for k, v in t.items() if k != Q_B}),
                  tensors_mutation("every tensor dropped", lambda t: {"unrelated": np.zeros(1, np.float32)}),
                  tensors_mutation("lm_head saved whole, [10, 256]",
                                   lambda t: {**t, "base_model.model.lm_head.weight": np.zeros((10, 256), np.float32)}),
                  header_mutation("header length 2^64-1", b"{}", 2**64 - 1),
                  header_mutation("header not JSON", b"{nope"),
                  header_mutation("header nested 100000 deep", b"[" * 100_000)]
    mutations.append(Mutation("lora", f"{WEIGHTS} missing", "lora", lambda bases, folder: str(
        linked_copy(bases.lora, folder / "adapter", {WEIGHTS: None}))))
    mutations.append(Mutation("lora", "the adapter folder is a file", "lora", _a_file))
    return mutations


def _a_file(bases: Bases, folder: Path) -> str:
    shutil.copy(Path(bases.lora) / CONFIG, folder / "adapter")
    return str(folder / "adapter")


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random config key given a random odd value, or a random tensor given a random shape."""
    if rng.random() < 0.5:
        key = rng.choice(("r", "lora_alpha", "use_rslora", "target_modules", "bias", "peft_type", "modules_to_save"))
        return set_keys(**{key: rng.choice(ODD_JSON_VALUES)})
    shape = tuple(rng.choice((0, 1, 2, 3, 255, 257, 689)) for _ in range(rng.choice((1, 2, 2, 3))))
    key = rng.choice((Q_A, Q_B, PREFIX + "mlp.down_proj.lora_A.weight", PREFIX + "self_attn.v_proj.lora_B.weight"))
    return replaced(key, lambda a: np.ones(shape, a.dtype) * 0.01, f"shape {list(shape)}")
