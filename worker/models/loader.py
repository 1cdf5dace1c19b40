"""Builds a model from a Hugging Face folder: config.json and safetensors weights by name (core process)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from worker.models.llama import LlamaArgs, LlamaModel

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


def read_config(model_dir: str) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = set(config.get("architectures") or [])
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {sorted(architectures)}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    args = LlamaArgs.from_hf_config(read_config(model_dir))
    with torch.device("meta"):
        model = LlamaModel(args)
    model = model.to_empty(device=device)
    state = _fuse(args, _read_safetensors(model_dir))
    model.load_state_dict(state, strict=False, assign=False)
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")
    model.rotary.__init__(
        args.head_dim, args.max_position_embeddings, args.rope_theta
    )  # buffers were on meta
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _read_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir}")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).float()
    return tensors


def _fuse(args: LlamaArgs, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames Hugging Face weights to this model's, concatenating q/k/v and gate/up."""
    state = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "lm_head.weight": hf["model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"],
    }
    for i in range(args.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        state[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        state[dst + "post_attention_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        state[dst + "qkv_proj.weight"] = torch.cat([hf[attn + f"{p}_proj.weight"] for p in "qkv"])
        if args.qkv_bias:
            state[dst + "qkv_proj.bias"] = torch.cat([hf[attn + f"{p}_proj.bias"] for p in "qkv"])
        state[dst + "o_proj.weight"] = hf[attn + "o_proj.weight"]
        state[dst + "gate_up_proj.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )
        state[dst + "down_proj.weight"] = hf[src + "mlp.down_proj.weight"]
    return state
