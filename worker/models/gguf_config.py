"""A GGUF file's metadata as the Hugging Face config.json it stands for, so that one reader
(`LlamaArgs.from_hf_config`) checks and builds every model (engine-core process).

GGUF names the architecture (`general.architecture`) and keeps its numbers under that prefix. Loaded:
`llama` (Llama 2/3 and SmolLM; Mistral too, which llama.cpp writes as `llama`: named so in
`general.name`, it becomes MistralForCausalLM as transformers makes it), `qwen2` and `qwen3`. Anything
else, and any key that changes the math (experts, RoPE frequencies stored as a tensor, other RoPE
scalings), is a ValueError naming it.
"""

from __future__ import annotations

from protocol.gguf_header import GGUFHeader

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# `<arch>.KEY` -> config.json key
_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
}
_REFUSED_KEYS = ("expert_count", "attention.logit_softcapping", "final_logit_softcapping")
_ROPE_SCALINGS = ("none", "linear", "yarn")


def gguf_architecture(header: GGUFHeader) -> str:
    arch = str(header.metadata.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(f"{header.path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)}")
    return arch


def hf_config_from_gguf(header: GGUFHeader) -> dict:
    """config.json's keys from the metadata. Weights are dequantized, so the checkpoint dtype is fp32."""
    arch = gguf_architecture(header)
    meta = header.metadata
    for key in _REFUSED_KEYS:
        if meta.get(f"{arch}.{key}") not in (None, 0):
            raise ValueError(f"{header.path}: GGUF key {arch}.{key}={meta[f'{arch}.{key}']!r} is not supported")
    names = {t.name for t in header.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{header.path}: RoPE frequencies stored as a tensor (rope_freqs.weight, Llama 3.1's "
                         "scaling in GGUF) are not supported")
    config = {key: meta[f"{arch}.{gguf_key}"] for gguf_key, key in _KEYS.items() if f"{arch}.{gguf_key}" in meta}
    if "vocab_size" not in config:  # older files: one embedding row per token
        config["vocab_size"] = len(meta.get("tokenizer.ggml.tokens", []))
    is_mistral = arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower()
    family = "mistral" if is_mistral else arch
    config.update(
        architectures=["MistralForCausalLM" if is_mistral else ARCHITECTURES[arch]],
        model_type=family,
        hidden_act="silu",
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch != "qwen2" and "blk.0.attn_q.bias" in names,
        rope_parameters=_rope_parameters(header, arch, float(config.get("rope_theta", 10000.0))),
        torch_dtype="float32",
    )
    if family == "qwen2" and "blk.0.attn_q.bias" not in names:
        raise ValueError(f"{header.path}: a qwen2 GGUF without q/k/v biases is not a Qwen2 model")
    if arch == "llama":  # its RoPE covers whole heads: the rotary dimension is the head's
        config.setdefault("head_dim", int(meta.get(f"{arch}.rope.dimension_count", 0)) or None)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    config.update({k: int(v) for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None})
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in config.items() if v is not None}


def _rope_parameters(header: GGUFHeader, arch: str, theta: float) -> dict:
    meta = header.metadata
    scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    if scaling not in _ROPE_SCALINGS:
        raise ValueError(f"{header.path}: GGUF RoPE scaling {scaling!r} is not supported; supported: "
                         f"{list(_ROPE_SCALINGS)}")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": scaling, "rope_theta": theta, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        params["original_max_position_embeddings"] = int(original)
    return params
