"""A PEFT LoRA adapter as saved (`adapter_config.json` + `adapter_model.safetensors`), read against the
loaded model (engine-core process): each target's A [r, in] and B [out, r] in fp32 and its scale, keyed
by the model's module that takes the delta, and the copies of `modules_to_save` (lm_head, embed_tokens).

PEFT's unmerged forward is base(x) + B(A(x)) * scale, with scale = alpha / r (rslora: alpha /
sqrt(r)); on an embedding, base(ids) + (A^T[ids] B^T) * scale. The model fuses q/k/v and gate/up into
one product each, so a target q_proj, k_proj or v_proj is a part of qkv_proj's output columns (Phi-3's
own fused qkv_proj and gate_up_proj take the whole). An adapter is untrusted input: every tensor's name
and shape is checked against its own target's sizes as the model's config gives them (a k_proj B of
more rows than k's width is refused, never written into v's columns) before any tensor's data is read
(coreserve/worker/lora/adapter_files.py reads the config and the header), and every value read must be finite.
What is not built is refused by name: DoRA, other PEFT types, LoRA biases, per-module rank or alpha
patterns, the experts of a mixture, an embedding LoRA on a model that scales its embedding (Gemma), and
a rank above max_lora_rank.

Under tensor parallelism each rank reads the file, checks it against the whole model's sizes, and keeps
its shard of each pair, split as the module's own weight is (coreserve/worker/models/sharding.py's
`rank_lora_pair`): its rows of a q/k/v or gate/up B, its columns of an o or down A.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from coreserve.worker.lora.adapter_files import (
    WEIGHTS_FILE,
    AdapterConfig,
    check_shape,
    read_config,
    read_header,
)
from coreserve.worker.models.quantized import block_values
from coreserve.worker.models.sharding import Shard, rank_lora_pair

_PREFIX = "base_model.model."
MAX_PRODUCT_RANK = 1024  # an adapter's ranks for one product, its parts together (csrc/lora_rows.c's bound)
_PAIR_PARTS = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")
_WHOLE_MODULES = ("lm_head", "model.embed_tokens")  # modules_to_save (and their `.base_layer`)
_FP32_MAX = torch.finfo(torch.float32).max


@dataclass
class LowRank:
    """One module's delta: columns [start, start + out) of its output get (x A^T) B^T * scale."""

    a: nn.Linear  # weight [r, in] fp32
    b: nn.Linear  # weight [out, r] fp32
    scale: float
    start: int = 0


@dataclass(frozen=True)
class Target:
    """Where a PEFT target's delta goes: the model's module and the target's own sizes in it."""

    module: nn.Module
    start: int  # the first of the module's output columns (this rank's) that are the target's
    in_features: int  # A is [r, in_features] (the whole model's, as the file holds it)
    widths: tuple[int, ...]  # B's rows, part by part (a fused qkv_proj's q, k, v): the target's own width

    @property
    def out_features(self) -> int:  # B is [out_features, r] (k_proj: k's width, not q/k/v's)
        return sum(self.widths)


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
    packed: dict = field(default_factory=dict)  # by module: a backend's form of its parts (coreserve/worker/cpu/grouped_lora.py)

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


def read_adapter(path: str, name: str, model: nn.Module, max_rank: int, shard: Shard | None = None) -> LoraAdapter:
    """The adapter at `path` (a folder), checked against `model` (coreserve/worker/models/decoder.py's DecoderModel):
    every name and shape from the file's header first, then each tensor's values as it is read. `shard`:
    `model` is this rank's part of a tensor-parallel model, and the adapter's pairs are cut alike."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    config = read_config(folder, max_rank)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE} (adapter_model.bin is not read)")
    try:
        with safe_open(str(weights_file), framework="pt") as handle:
            shapes = read_header(handle, path)
            pairs, wholes = _group(shapes, path)
            size = 1 if shard is None else shard.size
            targets = {module: _check_pair(module, keys, shapes, config.rank, model, size, path)
                       for module, keys in pairs.items()}
            for key in wholes:
                check_shape(key, shapes[key], (model.args.vocab_size, model.args.hidden_size), path,
                            "the model's vocabulary x hidden size; a resized vocabulary is not built")
            _check_product_ranks(targets, config.rank, path)
            tensors = {key: _read_finite(handle, key, path) for key in shapes}
    except SafetensorError as exc:  # a header that overflows or does not tile the file, a short file
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is not a valid safetensors file ({exc})") from exc
    return _build(name, config, pairs, targets, wholes, tensors, model, shard, path)


def _group(shapes: dict[str, tuple[int, ...]], path: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The file's tensor names as LoRA pairs (PEFT module name -> {"lora_A": key, ...}) and whole
    modules (modules_to_save copies, `.base_layer` weights); any other name is refused."""
    pairs: dict[str, dict[str, str]] = {}
    wholes = []
    for key in shapes:
        if not key.startswith(_PREFIX):
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not named as PEFT saves a causal LM's")
        short = key[len(_PREFIX):]
        part = next((p for p in _PAIR_PARTS if short.endswith(p)), None)
        if part is not None:
            pairs.setdefault(short[: -len(part)], {})[part.split(".")[1]] = key
            continue
        module = short.removesuffix(".weight").removesuffix(".base_layer")
        if module not in _WHOLE_MODULES or not short.endswith(".weight"):
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not built (modules_to_save: lm_head and "
                             "embed_tokens only)")
        wholes.append(key)
    return pairs, wholes


def _check_pair(module_name: str, keys: dict[str, str], shapes: dict[str, tuple[int, ...]], rank: int,
                model: nn.Module, size: int, path: str) -> Target | None:
    """A [r, in] and B [out, r] of `module_name` checked against its own sizes in the whole model (r: the
    config's; `size`: the ranks `model` is one of); its Target (None: an embedding LoRA)."""
    if set(keys) not in ({"lora_A", "lora_B"}, {"lora_embedding_A", "lora_embedding_B"}):
        raise ValueError(f"LoRA adapter {path!r}: {module_name} has {sorted(keys)}: it lacks its A or B")
    if "lora_A" in keys:
        target = _target(model, module_name, size, path)
        sizes, why = (target.in_features, target.out_features), f"{module_name} takes {target.in_features} in"
        why += f" and gives {target.out_features} out in this model; r={rank} in adapter_config.json"
    else:
        _check_embedding(module_name, model, path)
        target, sizes = None, (model.args.vocab_size, model.args.hidden_size)
        why = f"the model's vocabulary x hidden size; r={rank} in adapter_config.json"
    a_key, b_key = sorted(keys.values())  # lora_A before lora_B, lora_embedding_A before lora_embedding_B
    check_shape(a_key, shapes[a_key], (rank, sizes[0]), path, why)
    check_shape(b_key, shapes[b_key], (sizes[1], rank), path, why)
    return target


def _check_embedding(module_name: str, model: nn.Module, path: str) -> None:
    if module_name != "model.embed_tokens":
        raise ValueError(f"LoRA adapter {path!r}: an embedding LoRA on {module_name} is not built")
    if model.args.embed_scale is not None:
        raise ValueError(f"LoRA adapter {path!r}: an embed_tokens LoRA on a model that scales its embedding "
                         "(Gemma) is not built")


def _check_product_ranks(targets: dict[str, Target | None], rank: int, path: str) -> None:
    counts = Counter(t.module for t in targets.values() if t is not None)
    if counts and max(counts.values()) * rank > MAX_PRODUCT_RANK:
        raise ValueError(f"LoRA adapter {path!r}: its targets of one product have {max(counts.values())} x r={rank} "
                         f"ranks, more than the {MAX_PRODUCT_RANK} the kernels take (r <= {MAX_PRODUCT_RANK // 3} "
                         "with q, k and v all targeted)")


def _read_finite(handle, key: str, path: str) -> torch.Tensor:
    """The tensor in fp32, the form every use takes (an F64 value past fp32's range is an Inf here)."""
    tensor = handle.get_tensor(key).float()
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} holds non-finite values (NaN or Inf) in fp32")
    return tensor


def _build(name: str, config: AdapterConfig, pairs: dict[str, dict[str, str]], targets: dict[str, Target | None],
           wholes: list[str], tensors: dict[str, torch.Tensor], model: nn.Module, shard: Shard | None,
           path: str) -> LoraAdapter:
    """The adapter from its checked tensors (this rank's shard of each pair), on the model's device."""
    device = model.norm.weight.device  # the adapter lives where the model computes
    tensors = {key: t.to(device) for key, t in tensors.items()}
    adapter = LoraAdapter(name, config.rank)
    for key in wholes:
        _whole_module(adapter, key, tensors[key], model, path)
    for module_name, keys in sorted(pairs.items()):  # a fixed order of parts: the kernels' order of sums
        a_key, b_key = sorted(keys.values())
        a, b = tensors[a_key], tensors[b_key]
        if b.numel() and float(b.abs().max()) * config.scale > _FP32_MAX:
            raise ValueError(f"LoRA adapter {path!r}: tensor {b_key!r} times the scale {config.scale:g} (lora_alpha "
                             "and r in adapter_config.json) passes fp32's range")
        target = targets[module_name]
        if target is None:  # a [r, vocab], b [hidden, r]
            adapter.embed_a, adapter.embed_b, adapter.embed_scale = a.float().t().contiguous(), frozen_linear(b), config.scale
            continue
        if shard is not None:
            a, b = rank_lora_pair(module_name, a, b, target.widths, shard)
        part = LowRank(frozen_linear(a), frozen_linear(b), config.scale, target.start)
        adapter.deltas.setdefault(target.module, []).append(part)
    return adapter


def _whole_module(adapter: LoraAdapter, key: str, value: torch.Tensor, model: nn.Module, path: str) -> None:
    """modules_to_save copies (lm_head.weight, model.embed_tokens.weight) and the base weights PEFT saves
    beside an embedding or lm_head LoRA (`.base_layer.weight`, which must be the model's own); shapes
    checked already."""
    modules = {"lm_head": model.lm_head, "model.embed_tokens": model.embed_tokens}
    short = key[len(_PREFIX):]
    module = short.removesuffix(".weight").removesuffix(".base_layer")
    own = modules[module].weight
    if ".base_layer." in short:
        values = own if own.is_floating_point() else block_values(own)  # GGUF blocks: their fp32 values
        if not torch.equal(value.to(device=values.device, dtype=values.dtype), values):
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} differs from the model's {module}")
        return
    if not own.is_floating_point():
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save {module} over a table kept in GGUF blocks is not built")
    if module == "lm_head":
        adapter.lm_head = frozen_linear(value)
    else:
        adapter.embed_tokens = value.float().contiguous()


def _target(model: nn.Module, name: str, size: int, path: str) -> Target:
    """Where `name`'s delta goes (a PEFT module name), with the target's own sizes from the model's config
    (the whole model's: `model` is one of `size` ranks' parts)."""
    args = model.args
    if name == "lm_head":  # whole on every rank
        return Target(model.lm_head, 0, args.hidden_size, (args.vocab_size,))
    if ".experts." in name or name.endswith((".gate", ".block_sparse_moe.gate")):
        raise ValueError(f"LoRA adapter {path!r}: LoRA on a mixture's experts or router ({name}) is not built")
    parts = name.split(".")
    roles = _roles(args, size)
    if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdecimal() or parts[4] not in roles \
            or parts[3] != roles[parts[4]][0]:
        raise ValueError(f"LoRA adapter {path!r}: target {name!r} is not built (self_attn's q/k/v/o, mlp's "
                         "gate/up/down, lm_head, embed_tokens)")
    if int(parts[2]) >= len(model.layers):
        raise ValueError(f"LoRA adapter {path!r}: {name} names a layer the model does not have")
    layer = model.layers[int(parts[2])]
    container, attribute, start, in_features, widths = roles[parts[4]]
    if container == "mlp" and layer.moe is not None:
        raise ValueError(f"LoRA adapter {path!r}: target {name!r} is not built (layer {parts[2]}'s MLP is a "
                         "mixture of experts)")
    # a rank's fused module holds its share of each part, in the same order: its columns start at start / size
    return Target(getattr(layer, attribute), start // size, in_features, widths)


def _roles(args, size: int) -> dict[str, tuple[str, str, int, int, tuple[int, ...]]]:
    """PEFT's target name -> (its container, the model's fused module, first column, in, B's parts' widths),
    the whole model's sizes (`args` are one of `size` ranks' share of the heads and MLP columns)."""
    hidden, inter = args.hidden_size, args.intermediate_size * size
    q, kv = args.num_heads * size * args.head_dim, args.num_kv_heads * size * args.head_dim
    return {
        "q_proj": ("self_attn", "qkv_proj", 0, hidden, (q,)),
        "k_proj": ("self_attn", "qkv_proj", q, hidden, (kv,)),
        "v_proj": ("self_attn", "qkv_proj", q + kv, hidden, (kv,)),
        "qkv_proj": ("self_attn", "qkv_proj", 0, hidden, (q, kv, kv)),  # Phi-3's own fused one
        "o_proj": ("self_attn", "o_proj", 0, q, (hidden,)),
        "gate_proj": ("mlp", "gate_up_proj", 0, hidden, (inter,)),
        "up_proj": ("mlp", "gate_up_proj", inter, hidden, (inter,)),
        "gate_up_proj": ("mlp", "gate_up_proj", 0, hidden, (inter, inter)),  # Phi-3's own fused one
        "down_proj": ("mlp", "down_proj", 0, inter, (hidden,)),
    }
