"""Shared pieces of the benchmark scripts: seeded synthetic prompts, timing, tables and JSON."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np


def sharegpt_like_lengths(
    num: int,
    seed: int = 0,
    mean_input: float = 215,
    mean_output: float = 128,
    max_input: int = 1024,
    max_output: int = 512,
) -> tuple[list[int], list[int]]:
    """Long-tailed input and output lengths, log-normal with ShareGPT-like means (about 215 and 128 tokens),
    clipped to the given maxima."""
    rng = np.random.default_rng(seed)

    def draw(mean: float, sigma: float, low: int, high: int) -> list[int]:
        values = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, num)
        return np.clip(np.round(values), low, high).astype(int).tolist()

    return draw(mean_input, 0.8, 8, max_input), draw(mean_output, 0.9, 4, max_output)


def prompts_of_lengths(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    words = tokenizer(" the of and to in is was for on that with as by at from his her it are were").input_ids
    return [rng.choice(words, n).tolist() for n in lengths]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return "" if value is None else str(value)


def write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
