"""A sentence-transformers folder's modules after its transformer (engine-core process): modules.json names
them in order, the Pooling module's config.json its mode, each Dense module's config.json its sizes, bias and
activation beside a safetensors file, and a Normalize module the L2 norm at the end.

Every file is untrusted input: each module's path must stay inside the folder, every size is checked against
the chain (the transformer's hidden size, then each layer's input the last one's output) and against the
safetensors header before a byte of a weight is read. A module or mode not built is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from coreserve.worker.models.safetensors_files import read_header

ST = "sentence_transformers.models."
MODULES = {ST + "Transformer": "transformer", ST + "Pooling": "pooling", ST + "Dense": "dense",
           ST + "Normalize": "normalize"}
# 1_Pooling/config.json's modes: the built ones, and those refused by name
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
UNBUILT_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# a Dense module's activation_function -> the pooler's (None: none)
ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": "tanh"}
MAX_FEATURES = 1 << 20
MAX_MODULES = 64


@dataclass(frozen=True)
class DenseSpec:
    weights: Path  # its model.safetensors: linear.weight [out, in], linear.bias [out] where it has one
    in_features: int
    out_features: int
    has_bias: bool
    activation: str | None  # "tanh", or None


@dataclass(frozen=True)
class StModules:
    pooling: str  # "cls", "mean" or "last"
    dense: tuple[DenseSpec, ...]
    normalizes: bool


def read_st_modules(folder: Path, hidden_size: int) -> StModules | None:
    """The folder's modules after the transformer; None where it has no modules.json (not a
    sentence-transformers folder)."""
    if not (folder / "modules.json").is_file():
        return None
    entries = _json(folder / "modules.json")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_MODULES:
        raise ValueError(f"modules.json must be a list of 1..{MAX_MODULES} modules")
    kinds = [_kind(entry) for entry in entries]
    if kinds[0][0] != "transformer" or kinds[0][1] != "":
        raise ValueError("modules.json: the first module must be the Transformer at the folder's root (path \"\")")
    if [kind for kind, _ in kinds[1:2]] != ["pooling"]:
        raise ValueError("modules.json: a Pooling module must follow the Transformer")
    normalizes = len(kinds) > 2 and kinds[-1][0] == "normalize"
    dense_paths = [path for kind, path in kinds[2 : len(kinds) - normalizes]]
    if any(kind != "dense" for kind, _ in kinds[2 : len(kinds) - normalizes]):
        raise ValueError("modules.json: after Pooling only Dense modules, then at most one Normalize, are built")
    pooling = _pooling_mode(_inside(folder, kinds[1][1]) / "config.json", hidden_size)
    dense, width = [], hidden_size
    for path in dense_paths:
        dense.append(_dense(_inside(folder, path), width))
        width = dense[-1].out_features
    return StModules(pooling, tuple(dense), normalizes)


def _kind(entry: object) -> tuple[str, str]:
    """(the module's kind, its path) of a modules.json entry."""
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str) or not isinstance(entry.get("path"), str):
        raise ValueError(f"modules.json: each module needs a type and a path (strings), got {str(entry)[:100]}")
    kind = MODULES.get(entry["type"])
    if kind is None:
        raise ValueError(f"modules.json: module {entry['type'][:100]!r} is not built (built: {sorted(MODULES)})")
    return kind, entry["path"]


def _inside(folder: Path, relative: str) -> Path:
    """A module's folder, which must lie inside the model's folder (an untrusted path)."""
    path = (folder / relative).resolve()
    if Path(relative).is_absolute() or not path.is_relative_to(folder.resolve()):
        raise ValueError(f"modules.json: module path {relative[:100]!r} leaves the model's folder")
    return path


def _pooling_mode(path: Path, hidden_size: int) -> str:
    config = _json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object")
    width = config.get("word_embedding_dimension")
    if width != hidden_size:
        raise ValueError(f"{path}: word_embedding_dimension={str(width)[:40]} is not the model's hidden size "
                         f"{hidden_size}")
    for key in UNBUILT_MODES:
        if config.get(key):
            raise ValueError(f"{path}: {key} is not built (built: {sorted(POOLING_MODES)})")
    modes = [mode for key, mode in POOLING_MODES.items() if config.get(key) is True]
    if len(modes) != 1:
        raise ValueError(f"{path}: exactly one of {sorted(POOLING_MODES)} must be true")
    return modes[0]


def _dense(folder: Path, in_width: int) -> DenseSpec:
    config = _json(folder / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{folder}/config.json must be a JSON object")
    sizes = [config.get("in_features"), config.get("out_features")]
    if any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FEATURES for n in sizes):
        raise ValueError(f"{folder}/config.json: in_features and out_features must be integers in "
                         f"1..{MAX_FEATURES}, got {str(sizes)[:80]}")
    if sizes[0] != in_width:
        raise ValueError(f"{folder}/config.json: in_features={sizes[0]}, but the module before gives {in_width}")
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")  # sentence-transformers'
    if activation not in ACTIVATIONS:
        raise ValueError(f"{folder}/config.json: activation_function {str(activation)[:80]!r} is not built "
                         f"(built: {sorted(ACTIVATIONS)})")
    has_bias = config.get("bias", True)
    if not isinstance(has_bias, bool):
        raise ValueError(f"{folder}/config.json: bias must be true or false")
    spec = DenseSpec(folder / "model.safetensors", sizes[0], sizes[1], has_bias, ACTIVATIONS[activation])
    _check_dense_file(spec)
    return spec


def _check_dense_file(spec: DenseSpec) -> None:
    """The module's safetensors holds linear.weight [out, in] and linear.bias [out] where bias is true, and
    nothing else, in a floating dtype."""
    if not spec.weights.is_file():
        raise ValueError(f"{spec.weights.parent}: no model.safetensors (a pytorch_model.bin is not read: convert it)")
    shapes = {entry.name: (entry.shape, entry.dtype) for entry in read_header(spec.weights)}
    wanted = {"linear.weight": (spec.out_features, spec.in_features)}
    if spec.has_bias:
        wanted["linear.bias"] = (spec.out_features,)
    got = {name: tuple(shape) for name, (shape, _) in shapes.items()}
    if got != wanted:
        raise ValueError(f"{spec.weights}: tensors {str(got)[:160]}; its config.json makes them {wanted}")
    if not all(dtype.is_floating_point for _, dtype in shapes.values()):
        raise ValueError(f"{spec.weights}: a Dense layer's tensors must be floating point")


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path} is not a JSON file: {type(exc).__name__}") from None
