"""A PEFT adapter folder's two files read as untrusted input (engine-core process), before any tensor is
used: `adapter_config.json` field by field (a JSON object; `r` a positive integer; `lora_alpha` a finite
number >= 0; what is not built refused by name), and `adapter_model.safetensors`' header (each tensor's
dtype and shape, no data read), which coreserve/worker/lora/adapter.py checks against the model before it reads a
tensor. The safetensors library itself refuses a header whose shapes overflow or whose byte ranges do not
tile the file. Every refusal is a ValueError naming the field or the tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names; an adapter's A and B are floats
_REFUSED_TRUE = {"use_dora": "DoRA", "use_qalora": "QA-LoRA", "lora_bias": "LoRA biases (lora_bias)"}
_NOT_BUILT = ("rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication", "trainable_token_indices")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int  # r: every A is [r, in] and every B [out, r] (per-module ranks are refused)
    alpha: float
    use_rslora: bool

    @property
    def scale(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rslora."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def read_config(path: Path, max_rank: int) -> AdapterConfig:
    """`path`/adapter_config.json checked; a ValueError names the field."""
    config_file = path / CONFIG_FILE
    if not path.exists():
        raise ValueError(f"LoRA adapter {str(path)!r} not found")
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no {CONFIG_FILE} (a PEFT adapter folder is expected)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} must be a JSON object, got a "
                         f"{type(config).__name__}")
    _refuse_what_is_not_built(config, str(path))
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)  # PEFT's defaults
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {str(path)!r}: r must be a positive integer, got {rank!r}")
    if not 0 <= _as_float(alpha) < math.inf:  # NaN, not a number, an int past a float: nan
        raise ValueError(f"LoRA adapter {str(path)!r}: lora_alpha must be a finite number >= 0, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise ValueError(f"LoRA adapter {str(path)!r}: use_rslora must be true or false, got {use_rslora!r}")
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"LoRA adapter {str(path)!r}: target_modules must be a list of module names or a "
                         f"regular expression, got {targets!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {str(path)!r}: LoRA rank {rank} is greater than max_lora_rank "
                         f"{max_rank} (--max-lora-rank)")
    return AdapterConfig(rank, float(alpha), use_rslora)


def _as_float(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.nan


def _refuse_what_is_not_built(config: dict, path: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {config['peft_type']!r} is not built (LORA only)")
    for key, what in _REFUSED_TRUE.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: coreserve does not yet support {what} ({key})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r}: Adapter bias cannot be used "
                         "without bias_enabled, which coreserve does not build (bias='none' only)")
    for key in _NOT_BUILT:
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key} is not built")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {path!r}: fan_in_fan_out (Conv1D layers) is not built")


def read_header(handle, path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by name from an open safetensors file (`safe_open`'s handle), no data read;
    a tensor that is not of a float dtype is refused by name."""
    shapes = {}
    for key in handle.keys():
        piece = handle.get_slice(key)
        if piece.get_dtype() not in FLOAT_DTYPES:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is {piece.get_dtype()}, not a float "
                             f"({', '.join(FLOAT_DTYPES)})")
        shapes[key] = tuple(piece.get_shape())
    return shapes


def check_shape(key: str, shape: tuple[int, ...], expected: tuple[int, ...], path: str, why: str) -> None:
    if shape != expected:
        raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} has shape {shape}, expected {expected} ({why})")
