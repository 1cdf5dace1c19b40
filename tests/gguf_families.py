"""GGUF twins of the family test models (conftest's write_family_model): the same weights written with
the `gguf` package's writer as llama.cpp's converter writes each architecture (its tensor names, q/k
rows interleaved for `llama`, Phi-3's fused q/k/v and gate/up, experts stacked [experts, rows, columns],
Gemma's norms as 1 + weight, LongRoPE's factors as tensors), the metadata llama.cpp writes, and GPT-2's
tokens cut to the model's vocabulary. Returns the HF-named fp32 values a correct reader must give (the
dequantized ones; Gemma's norms (1 + w) - 1), for a safetensors twin with the family's config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from gguf_files import add_gpt2_tokenizer, interleave_heads, quantized

# family -> (GGUF architecture, general.name)
ARCHS = {"mixtral": ("llama", "mixtral test"), "qwen3_moe": ("qwen3moe", "t"), "olmoe": ("olmoe", "t"),
         "phi3": ("phi3", "t"), "phi4-mini": ("phi3", "t"), "gemma2": ("gemma2", "t"), "gemma3": ("gemma3", "t")}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERT_ROLES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_family_gguf(source: str, family: str, path: Path, weight_type: str = "F32") -> dict[str, np.ndarray]:
    """`source`'s model (an fp32 family folder) as a GGUF at `path`, 2-D weights in `weight_type`."""
    import gguf
    from gguf import GGMLQuantizationType, quants
    from safetensors.numpy import load_file

    config = json.loads((Path(source) / "config.json").read_text())
    arch, name = ARCHS[family]
    tensors = load_file(str(Path(source) / "model.safetensors"))
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, name, config, tensors)
    expected, experts = {}, {}
    for hf, values in sorted(tensors.items()):
        if config.get("tie_word_embeddings") and hf == "lm_head.weight":
            continue
        target = _gguf_name(hf, arch)
        if target.startswith("expert:"):  # stacked below, per layer and role, in expert order
            experts.setdefault(target, {})[int(hf.split(".")[5])] = (hf, values)
            continue
        kind = weight_type if values.ndim == 2 and values.shape[1] % 32 == 0 and "gate_inp" not in target else "F32"
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            values = values + np.float32(1.0)  # llama.cpp's converter; a reader takes 1 off again
        stored = quantized(values if values.ndim > 1 else values[None], kind, rng)
        stored = stored if values.ndim > 1 else stored[0]
        value = quants.dequantize(stored, GGMLQuantizationType[kind]).reshape(values.shape).astype(np.float32)
        expected[hf] = value - np.float32(1.0) if arch.startswith("gemma") and hf.endswith("norm.weight") else value
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        if arch == "llama" and target.split(".")[-2] in heads:
            stored = interleave_heads(stored, heads[target.split(".")[-2]])
        writer.add_tensor(target, stored, raw_dtype=GGMLQuantizationType[kind])
    for target, by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e][1] for e in sorted(by_expert)])  # [experts, rows, columns]
        stored = quantized(stacked.reshape(-1, stacked.shape[-1]), weight_type, rng)
        value = quants.dequantize(stored, GGMLQuantizationType[weight_type]).reshape(stacked.shape)
        for e in sorted(by_expert):
            expected[by_expert[e][0]] = value[e].astype(np.float32)
        writer.add_tensor(target.removeprefix("expert:"), stored.reshape(len(by_expert), stacked.shape[1], -1),
                          raw_dtype=GGMLQuantizationType[weight_type])
    if "long_factor" in (config.get("rope_parameters") or {}):
        for key in ("long_factor", "short_factor"):
            writer.add_tensor(f"rope_factors_{key.split('_')[0]}.weight",
                              np.asarray(config["rope_parameters"][key], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_family_twin(folder: Path, source: str, expected: dict[str, np.ndarray], tokenizer_folder: str) -> str:
    """The family's config.json over `expected`'s values, with the GGUF's tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(expected, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(source) / "config.json").read_text())
    config["rms_norm_eps"] = float(np.float32(config["rms_norm_eps"]))  # GGUF stores it as a float32
    config["bos_token_id"] = config["eos_token_id"] = config["vocab_size"] - 1
    if config["model_type"].startswith("gemma"):  # no GGUF key: llama.cpp's is the head size's (but 27B's)
        config["query_pre_attn_scalar"] = config["head_dim"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for item in Path(tokenizer_folder).iterdir():
        shutil.copy(item, folder / item.name)
    return str(folder)


def _gguf_name(hf: str, arch: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, kind = hf.rsplit(".", 1)
    if module in top:
        return f"{top[module]}.{kind}"
    parts = module.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    if len(parts) == 7 and parts[4] == "experts":
        return f"expert:blk.{layer}.{_EXPERT_ROLES[parts[6]]}.{kind}"
    names = {**_LAYER, **(_GEMMA_LAYER if arch.startswith("gemma") else {})}
    return f"blk.{layer}.{names[rest]}.{kind}"


def _metadata(writer, arch: str, name: str, config: dict, tensors: dict) -> None:
    add = writer.add_uint32
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "longrope":
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", _longrope_attention(config, rope))
        add(f"{arch}.rope.scaling.original_context_length", config["original_max_position_embeddings"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    inter = config.get("moe_intermediate_size") if experts and arch == "qwen3moe" else None
    writer.add_feed_forward_length(config["intermediate_size"])
    if experts:
        add(f"{arch}.expert_count", experts)
        add(f"{arch}.expert_used_count", config["num_experts_per_tok"])
    if inter:
        add(f"{arch}.expert_feed_forward_length", inter)
    if config.get("sliding_window"):
        add(f"{arch}.attention.sliding_window", config["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            writer.add_float32(f"{arch}.{key}", config[key])
    if config.get("clip_qkv"):
        writer.add_float32(f"{arch}.attention.clamp_kqv", config["clip_qkv"])
    if arch == "gemma3":
        writer.add_float32(f"{arch}.rope.freq_base_swa", config["rope_parameters"]["sliding_attention"]["rope_theta"])
        add(f"{arch}.attention.sliding_window_pattern", 2)  # the test config's: local, global
    add_gpt2_tokenizer(writer, tensors["model.embed_tokens.weight"].shape[0])


def _longrope_attention(config: dict, rope: dict) -> float:
    """HF's attention factor when the config gives none: sqrt(1 + ln(factor) / ln(original))."""
    import math

    factor = config["max_position_embeddings"] / config["original_max_position_embeddings"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(config["original_max_position_embeddings"]))
