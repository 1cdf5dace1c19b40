"""A PEFT LoRA adapter as saved (`adapter_config.json` + `adapter_model.safetensors`), read against the
loaded model (engine-core process): each target's A [r, in] and B [out, r] in fp32 and its scale, keyed
by the model's module that takes the delta, and the copies of `modules_to_save` (lm_head, embed_tokens).

PEFT's unmerged forward is base(x) + B(A(x)) * scale, with scale = alpha / r (rslora: alpha /
sqrt(r)); on an embedding, base(ids) + (A^T[ids] B^T) * scale. The model fuses q/k/v and gate/up into
one product each, so a target q_proj, k_proj or v_proj is a part of qkv_proj's output columns (Phi-3's
own fused qkv_proj and gate_up_proj take the whole). What is not built is refused by name: DoRA, other
PEFT types, LoRA biases, per-module rank or alpha patterns, the experts of a mixture, an embedding LoRA
on a model that scales its embedding (Gemma), and a rank above max_lora_rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from worker.models.quantized import block_values

_PREFIX = "base_model.model."
MAX_PRODUCT_RANK = 1024  # an adapter's ranks for one product, its parts together (csrc/lora_rows.c's bound)
_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
_REFUSED_TRUE = {"use_dora": "DoRA", "use_qalora": "QA-LoRA", "lora_bias": "LoRA biases (lora_bias)"}


@dataclass
class LowRank:
    """One module's delta: columns [start, start + out) of its output get (x A^T) B^T * scale."""

    a: nn.Linear  # weight [r, in] fp32
    b: nn.Linear  # weight [out, r] fp32
    scale: float
    start: int = 0


@dataclass
class LoraAdapter:
    name: str
    rank: int
    deltas: dict[nn.Module, list[LowRank]] = field(default_factory=dict)  # by the model's module
    embed_a: torch.Tensor | None = None  # [vocab, r]: lora_embedding_A transposed, a row an id
    embed_b: nn.Linear | None = None  # weight [hidden, r]
    embed_scale: float = 1.0
    lm_head: nn.Linear | None = None  # modules_to_save: the adapter's whole lm_head
    embed_tokens: torch.Tensor | None = None  # modules_to_save: the adapter's whole table
    packed: dict = field(default_factory=dict)  # by module: the C kernel's form (worker/lora/lora_ops.py)

    @property
    def num_bytes(self) -> int:
        tensors = [t for parts in self.deltas.values() for p in parts for t in (p.a.weight, p.b.weight)]
        tensors += [t for t in (self.embed_a, self.embed_tokens) if t is not None]
        tensors += [m.weight for m in (self.embed_b, self.lm_head) if m is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def frozen_linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear over `weight` (fp32, contiguous, no grad): an adapter's A or B as the backends' products take it."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)
    return layer


def read_config(path: Path, max_rank: int) -> dict:
    config_file = path / "adapter_config.json"
    if not path.exists():
        raise ValueError(f"LoRA adapter {str(path)!r} not found")
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_config.json (a PEFT adapter folder is expected)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json is not JSON ({exc})") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r}: peft_type {config['peft_type']!r} is not built (LORA only)")
    for key, what in _REFUSED_TRUE.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {str(path)!r}: coreserve does not yet support {what} ({key})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {str(path)!r}: bias={config['bias']!r}: Adapter bias cannot be used "
                         "without bias_enabled, which coreserve does not build (bias='none' only)")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication", "trainable_token_indices"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {str(path)!r}: {key} is not built")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {str(path)!r}: fan_in_fan_out (Conv1D layers) is not built")
    if int(config["r"]) > max_rank:
        raise ValueError(f"LoRA adapter {str(path)!r}: LoRA rank {config['r']} is greater than max_lora_rank "
                         f"{max_rank} (--max-lora-rank)")
    return config


def read_adapter(path: str, name: str, model: nn.Module, max_rank: int) -> LoraAdapter:
    """The adapter at `path` (a folder), checked against `model` (worker/models/llama.py's LlamaModel)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config = read_config(folder, max_rank)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors (adapter_model.bin is not read)")
    device = model.norm.weight.device  # the adapter lives where the model computes
    tensors = {name: t.to(device) for name, t in load_file(str(weights_file)).items()}
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoraAdapter(name, rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if not key.startswith(_PREFIX):
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not named as PEFT saves a causal LM's")
        key = key[len(_PREFIX):]
        for part in (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B"):
            if key.endswith(part):
                pairs.setdefault(key[: -len(part)], {})[part.split(".")[1]] = value
                break
        else:
            _whole_module(adapter, key, value, model, path)
    for module_name, pair in sorted(pairs.items()):
        if set(pair) not in ({"lora_A", "lora_B"}, {"lora_embedding_A", "lora_embedding_B"}):
            raise ValueError(f"LoRA adapter {path!r}: {module_name} lacks its A or B")
        a, b = pair.get("lora_A", pair.get("lora_embedding_A")), pair.get("lora_B", pair.get("lora_embedding_B"))
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {path!r}: {module_name} A {tuple(a.shape)} / B {tuple(b.shape)} "
                             f"are not of its rank r={rank}")
        _add_pair(adapter, module_name, pair, scale, model, path)
    for parts in adapter.deltas.values():
        if sum(p.a.weight.shape[0] for p in parts) > MAX_PRODUCT_RANK:
            raise ValueError(f"LoRA adapter {path!r}: its targets of one product have {len(parts)} x r={rank} ranks, "
                             f"more than the {MAX_PRODUCT_RANK} the kernels take (r <= {MAX_PRODUCT_RANK // 3} "
                             "with q, k and v all targeted)")
    return adapter


def _whole_module(adapter: LoraAdapter, key: str, value: torch.Tensor, model: nn.Module, path: str) -> None:
    """modules_to_save copies (lm_head.weight, model.embed_tokens.weight) and the base weights PEFT saves
    beside an embedding or lm_head LoRA (`.base_layer.weight`, which must be the model's own)."""
    modules = {"lm_head": model.lm_head, "model.embed_tokens": model.embed_tokens}
    module = key.removesuffix(".weight").removesuffix(".base_layer")
    if module not in modules or not key.endswith(".weight"):
        raise ValueError(f"LoRA adapter {path!r}: {key!r} is not built (modules_to_save: lm_head and embed_tokens only)")
    own = modules[module].weight
    values = own if own.is_floating_point() else block_values(own)  # GGUF blocks: their fp32 values
    if tuple(value.shape) != tuple(values.shape):
        raise ValueError(f"LoRA adapter {path!r}: {key} has shape {tuple(value.shape)}, the model's "
                         f"{module} {tuple(values.shape)} (a resized vocabulary is not built)")
    if ".base_layer." in key:
        if not torch.equal(value.to(device=values.device, dtype=values.dtype), values):
            raise ValueError(f"LoRA adapter {path!r}: {key} differs from the model's {module}")
        return
    if not own.is_floating_point():
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save {module} over a table kept in GGUF blocks is not built")
    if module == "lm_head":
        adapter.lm_head = frozen_linear(value)
    else:
        adapter.embed_tokens = value.float().contiguous()


def _add_pair(adapter: LoraAdapter, name: str, pair: dict[str, torch.Tensor], scale: float, model: nn.Module,
              path: str) -> None:
    if "lora_embedding_A" in pair:
        if name != "model.embed_tokens":
            raise ValueError(f"LoRA adapter {path!r}: an embedding LoRA on {name} is not built")
        if model.args.embed_scale is not None:
            raise ValueError(f"LoRA adapter {path!r}: an embed_tokens LoRA on a model that scales its embedding "
                             "(Gemma) is not built")
        a, b = pair["lora_embedding_A"], pair["lora_embedding_B"]  # [r, vocab], [hidden, r]
        if a.shape[1] != model.args.vocab_size or b.shape[0] != model.args.hidden_size:
            raise ValueError(f"LoRA adapter {path!r}: embed_tokens A {tuple(a.shape)} / B {tuple(b.shape)} "
                             "do not fit the model")
        adapter.embed_a, adapter.embed_b, adapter.embed_scale = a.float().t().contiguous(), frozen_linear(b), scale
        return
    a, b = pair["lora_A"], pair["lora_B"]
    if ".experts." in name or name.endswith((".gate", ".block_sparse_moe.gate")):
        raise ValueError(f"LoRA adapter {path!r}: LoRA on a mixture's experts or router ({name}) is not built")
    module, start = _target(model, name, path)
    out_features = module.out_features if hasattr(module, "out_features") else module.weight.shape[0]
    in_features = module.in_features if hasattr(module, "in_features") else None
    if a.shape[0] != b.shape[1] or (in_features is not None and a.shape[1] != in_features) or start + b.shape[0] > out_features:
        raise ValueError(f"LoRA adapter {path!r}: {name} A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the model")
    adapter.deltas.setdefault(module, []).append(LowRank(frozen_linear(a), frozen_linear(b), scale, start))


def _target(model: nn.Module, name: str, path: str) -> tuple[nn.Module, int]:
    """The model's module that takes `name`'s delta (a PEFT module name), and the first output column."""
    if name == "lm_head":
        return model.lm_head, 0
    parts = name.split(".")
    if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        raise ValueError(f"LoRA adapter {path!r}: target {name!r} is not built (q/k/v/o, gate/up/down, lm_head, "
                         "embed_tokens)")
    index, role = int(parts[2]), parts[4]
    if index >= len(model.layers):
        raise ValueError(f"LoRA adapter {path!r}: {name} names a layer the model does not have")
    layer = model.layers[index]
    args = model.args
    q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    if role in _QKV:
        return layer.qkv_proj, (0, q_size, q_size + kv_size)[_QKV.index(role)]
    if role in ("qkv_proj", "o_proj"):
        return getattr(layer, role), 0
    if layer.moe is None and role in _GATE_UP:
        return layer.gate_up_proj, (0, args.intermediate_size)[_GATE_UP.index(role)]
    if layer.moe is None and role in ("gate_up_proj", "down_proj"):
        return getattr(layer, role), 0
    raise ValueError(f"LoRA adapter {path!r}: target {name!r} is not built (q/k/v/o, gate/up/down of a dense MLP, "
                     "lm_head, embed_tokens)")
