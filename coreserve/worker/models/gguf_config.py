"""A GGUF file's metadata as the Hugging Face config.json it stands for, so that one reader
(`DecoderArgs.from_hf_config`) checks and builds every model (engine-core process).

GGUF names the architecture (`general.architecture`) and keeps its numbers under that prefix. Loaded: `llama`
(Llama 2/3 and SmolLM; Mistral too, which llama.cpp writes as `llama`: named so in `general.name`, it becomes
MistralForCausalLM as transformers makes it; with experts, Mixtral), `qwen2`, `qwen3`, `qwen3moe`, `olmoe`,
`phi3` (LongRoPE's factors are tensors in the file), `gemma2`, `gemma3`, `qwen35` (Qwen3.5: its Gated
DeltaNet's keys read in coreserve/worker/models/gguf_recurrent.py; the layers of a multi-token-prediction
head, `nextn_predict_layers` blocks past the model's, are not the model's), `lfm2` (LFM2: its conv layers
marked by a KV head count of 0, read there too), `granitehybrid` (Granite 4.0-H: its Mamba2 layers marked so
too, its multipliers and NoPE, read there), `olmo2` (OLMo 2; OLMo 3 where it has windows), `smollm3` and
`exaone4` (their window layers read in coreserve/worker/models/gguf_windows.py), `gpt-oss` (its experts with
biases, split gate and up, and attention sinks: coreserve/worker/models/gguf_weights.py). What llama.cpp leaves out of
the metadata, it fixes in its code, and so here: Qwen3-MoE and Mixtral renormalise the top-k, OLMoE does not;
Gemma's query scale is the head size's except for the 27B shapes (46 layers of Gemma 2, 62 of Gemma 3: hidden
/ heads); Gemma 2 alternates local and global layers, Gemma 3 has 5 local to 1 global with a local RoPE base
of 10000 (`GGUF_ARCHS`, one entry of rules per architecture, the only place one is named). Anything else, and
any key that changes the math (RoPE frequencies stored as a tensor, other RoPE scalings), is a ValueError
naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from coreserve.protocol.gguf_header import GGUFHeader
from coreserve.worker.models.config_checks import check_config_numbers
from coreserve.worker.models.gguf_recurrent import (
    attention_kv_heads,
    linear_attention_keys,
    mamba2_keys,
    short_conv_keys,
)
from coreserve.worker.models.gguf_rope import longrope_keys, meta_number, rope_parameters
from coreserve.worker.models.gguf_windows import layer_kinds, window_keys


@dataclass(frozen=True)
class GgufArch:
    """A GGUF architecture's rules: the HF model it stands for, and what llama.cpp fixes in code."""

    architecture: str  # the HF architecture
    model_type: str
    with_experts: tuple[str, str] | None = None  # (architecture, model_type) where the file has experts
    by_name: tuple[str, str, str] | None = None  # (in general.name, architecture, model_type)
    interleaved_qk: bool = False  # q/k rows of each head interleaved in pairs (llama.cpp's permutation)
    head_dim_from_rope: bool = False  # the rotary dimension is the head's
    has_required_qkv_bias: bool = False  # q/k/v biases always (Qwen2); else attention_bias from the tensors
    activation: str = "silu"
    norms_plus_one: bool = False  # norms stored as 1 + weight (Gemma)
    renormalises_topk: bool = True  # build_moe_ffn's norm_w (OLMoE: not)
    has_dense_layers: bool = False  # layers without a router are mlp_only_layers, feed_forward_length theirs
    has_longrope_tensors: bool = False  # partial rotary and LongRoPE's factors as tensors (Phi-3)
    big_query_scale_layers: int | None = None  # the layer count whose query scale is hidden / heads (27B)
    has_local_layers: bool = False  # gemma3.attention.sliding_window_pattern and rope.freq_base_swa
    has_linear_attention: bool = False  # Gated DeltaNet layers (ssm.* keys) beside partial-rotary attention
    has_shared_expert: bool = False  # expert_shared_feed_forward_length: a gated shared expert's width (Qwen3-Next)
    tiles_value_heads: bool = False  # their value heads tiled, not grouped by key head (Qwen3.5: gguf_recurrent.py)
    has_short_conv: bool = False  # LFM2's conv layers: head_count_kv one a layer, 0 for a conv layer
    has_mamba2: bool = False  # Granite 4.0-H's Mamba2 layers (ssm.* keys), marked as LFM2's conv layers
    with_windows: tuple[str, str] | None = None  # (architecture, model_type) where the file has windows (OLMo 3)
    has_window_layers: bool = False  # sliding-window layers by attention.sliding_window_pattern (gguf_windows.py)
    has_local_rope: bool = False  # the sliding layers rotate at rope.freq_base_swa, unscaled (OLMo 3)
    window_pattern: int = 4  # load_swa_pattern's default: every n-th layer global where the file has no pattern
    # (swiglu_alpha, swiglu_limit) of the experts' clamped SwiGLU, constants in llama.cpp's code (gpt-oss)
    clamped_swiglu: tuple[float, float] | None = None


_GEMMA = dict(activation="gelu_pytorch_tanh", norms_plus_one=True)
# general.architecture -> its rules
GGUF_ARCHS = {
    "llama": GgufArch(
        "LlamaForCausalLM", "llama", with_experts=("MixtralForCausalLM", "mixtral"),
        by_name=("mistral", "MistralForCausalLM", "mistral"), interleaved_qk=True, head_dim_from_rope=True,
    ),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2", has_required_qkv_bias=True),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": GgufArch("Qwen3MoeForCausalLM", "qwen3_moe", has_dense_layers=True),
    "olmoe": GgufArch("OlmoeForCausalLM", "olmoe", renormalises_topk=False),
    "phi3": GgufArch("Phi3ForCausalLM", "phi3", has_longrope_tensors=True),
    "gemma2": GgufArch("Gemma2ForCausalLM", "gemma2", big_query_scale_layers=46, **_GEMMA),
    "gemma3": GgufArch("Gemma3ForCausalLM", "gemma3_text", big_query_scale_layers=62, has_local_layers=True, **_GEMMA),
    # every norm but the Gated DeltaNet's own (ssm_norm) stored as 1 + weight, as Gemma's
    "qwen35": GgufArch(
        "Qwen3_5ForCausalLM", "qwen3_5_text", norms_plus_one=True, has_linear_attention=True, tiles_value_heads=True,
    ),
    # Qwen3.5's layers over experts and a shared expert; its b/a projection (ssm_ba) grouped as HF's in_proj_ba
    "qwen3next": GgufArch(
        "Qwen3NextForCausalLM", "qwen3_next", norms_plus_one=True, has_linear_attention=True, has_dense_layers=True,
        has_shared_expert=True,
    ),
    "lfm2": GgufArch("Lfm2ForCausalLM", "lfm2", has_short_conv=True),
    # q/k rows interleaved as llama's (the converter permutes them, RoPE or not)
    "granitehybrid": GgufArch(
        "GraniteMoeHybridForCausalLM", "granitemoehybrid", interleaved_qk=True, has_mamba2=True,
    ),
    # OLMo 2, and OLMo 3 where the file has windows
    "olmo2": GgufArch(
        "Olmo2ForCausalLM", "olmo2", with_windows=("Olmo3ForCausalLM", "olmo3"), has_window_layers=True,
        has_local_rope=True,
    ),
    # llama's layout; no RoPE on every fourth layer, fixed in llama.cpp's code as in HF's default no_rope_layers
    "smollm3": GgufArch("SmolLM3ForCausalLM", "smollm3", interleaved_qk=True, head_dim_from_rope=True),
    # its windows read at any depth (llama.cpp applies them at 64 layers, the 32B's, alone: docs/models.md)
    "exaone4": GgufArch("Exaone4ForCausalLM", "exaone4", has_window_layers=True),
    # sliding and full layers alternating (pattern 2); the clamp's alpha and limit fixed in code; YaRN floored and
    # ceiled as llama.cpp always does (HF's truncate, true where absent: the hub's gpt-oss says false)
    "gpt-oss": GgufArch(
        "GptOssForCausalLM", "gpt_oss", has_window_layers=True, window_pattern=2, clamped_swiglu=(1.702, 7.0),
    ),
}
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
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "attention.clamp_kqv": "clip_qkv",
}
_REFUSED_KEYS = ("expert_shared_count", "attention.logit_softcapping")
GGUF_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def gguf_architecture(header: GGUFHeader) -> str:
    arch = str(header.metadata.get("general.architecture", ""))
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{header.path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{sorted(GGUF_ARCHS)}")
    return arch


def _hf_architecture(rules: GgufArch, meta: dict, has_experts: bool, has_windows: bool) -> tuple[str, str]:
    """(HF architecture, model_type): llama.cpp writes Mistral and Mixtral as `llama`, OLMo 3 as `olmo2`."""
    if has_experts and rules.with_experts is not None:
        return rules.with_experts
    if has_windows and rules.with_windows is not None:
        return rules.with_windows
    if rules.by_name is not None and rules.by_name[0] in str(meta.get("general.name", "")).lower():
        return rules.by_name[1:]
    return rules.architecture, rules.model_type


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
    num_draft = num_draft_layers(header, arch)
    if num_draft:  # block_count counts a multi-token-prediction head's layers too
        config["num_hidden_layers"] -= num_draft
    if "vocab_size" not in config:  # older files: one embedding row per token
        config["vocab_size"] = len(meta.get("tokenizer.ggml.tokens", []))
    rules = GGUF_ARCHS[arch]
    if rules.has_short_conv or rules.has_mamba2:  # head_count_kv one a layer, 0 for a recurrent layer
        config["num_key_value_heads"] = attention_kv_heads(header, arch)
    has_windows = bool(config.get("sliding_window")) and rules.has_window_layers
    architecture, model_type = _hf_architecture(rules, meta, bool(config.get("num_experts")), has_windows)
    has_bias = any(name.endswith(".attn_q.bias") for name in names)  # a hybrid's layer 0 has no attention
    theta = config.get("rope_theta", 10000.0)  # another type is left as it is, for the checks to refuse by name
    theta = float(theta) if isinstance(theta, int | float) and not isinstance(theta, bool) else theta
    config.update(
        architectures=[architecture],
        model_type=model_type,
        hidden_act=rules.activation,
        tie_word_embeddings="output.weight" not in names,
        attention_bias=not rules.has_required_qkv_bias and has_bias,
        rope_parameters=rope_parameters(header, arch, theta),
        torch_dtype="float32",
    )
    if rules.has_required_qkv_bias and not has_bias:
        raise ValueError(f"{header.path}: a {arch} GGUF without q/k/v biases is not a {architecture} model")
    if rules.head_dim_from_rope:  # its RoPE covers whole heads: the rotary dimension is the head's
        config.setdefault("head_dim", int(meta_number(header, f"{arch}.rope.dimension_count", 0)) or None)
    check_config_numbers(config, {v: f"{arch}.{k}" for k, v in _KEYS.items()}, GGUF_REQUIRED_KEYS)
    _check_head_sizes(header, arch, config)
    config.update(_family_keys(header, arch, config))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    config.update({k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None})  # checked
    kept = {k: (v.item() if hasattr(v, "item") else v) for k, v in config.items() if v is not None}
    if rules.has_window_layers and not has_windows:  # none: not the HF config's default window
        kept["sliding_window"] = None
    return kept


def _check_head_sizes(header: GGUFHeader, arch: str, config: dict) -> None:
    """v heads of the keys' size, and RoPE on whole heads where the architecture has no partial rotary (Phi-3's
    and the hybrids' are read with their keys): llama.cpp would read both keys, so a file that sets another
    value is refused by name rather than run otherwise (found by the untrusted-input fuzzer on gpt-oss)."""
    rules, meta = GGUF_ARCHS[arch], header.metadata
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    value_length = meta.get(f"{arch}.attention.value_length", head_dim)
    if value_length != head_dim:
        raise ValueError(f"{header.path}: GGUF key {arch}.attention.value_length={str(value_length)[:60]} differs "
                         f"from the key length {head_dim}: v heads of another size are not supported")
    has_partial = rules.has_longrope_tensors or rules.has_linear_attention or rules.has_mamba2
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if not has_partial and rotary != head_dim:
        raise ValueError(f"{header.path}: GGUF key {arch}.rope.dimension_count={str(rotary)[:60]} must be the head "
                         f"size {head_dim}: RoPE on part of each head is not supported for {arch}")


def _family_keys(header: GGUFHeader, arch: str, config: dict) -> dict:
    """The keys llama.cpp fixes in its code for an architecture rather than in the file's metadata."""
    meta, keys, rules = header.metadata, {}, GGUF_ARCHS[arch]
    if config.get("num_experts"):  # the top-k renormalised (build_moe_ffn's norm_w) where the rules say
        keys["norm_topk_prob"] = rules.renormalises_topk
        routers = {t.name for t in header.tensors if t.name.endswith("ffn_gate_inp.weight")}
        dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in routers]
        if dense and rules.has_dense_layers:  # layers without a router: Qwen3-MoE's mlp_only_layers
            keys["mlp_only_layers"] = dense
        if not rules.has_dense_layers or "intermediate_size" not in config:  # the experts' width where no other
            keys["intermediate_size"] = config.get("moe_intermediate_size") or config["intermediate_size"]
    if rules.has_longrope_tensors:
        keys.update(longrope_keys(header, arch, config))
    if rules.big_query_scale_layers is not None:
        layers, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
        is_27b = layers == rules.big_query_scale_layers
        keys["query_pre_attn_scalar"] = hidden // heads if is_27b else config.get("head_dim", hidden // heads)
    if rules.has_local_layers:
        keys["layer_types"] = layer_kinds(header, arch, config["num_hidden_layers"], 6)  # an int or a bool a layer
        keys["rope_local_base_freq"] = float(meta_number(header, f"{arch}.rope.freq_base_swa", 10000.0))
    if rules.has_window_layers:
        keys.update(window_keys(header, arch, config, rules.has_local_rope, rules.window_pattern))
    if rules.clamped_swiglu is not None:
        keys.update(_clamped_swiglu_keys(header, arch, config, rules.clamped_swiglu))
    if rules.has_shared_expert:  # checked as config.json's key is (coreserve/worker/models/config.py)
        keys["shared_expert_intermediate_size"] = meta.get(f"{arch}.expert_shared_feed_forward_length")
    if rules.has_linear_attention:
        keys.update(linear_attention_keys(header, arch, config))
    if rules.has_short_conv:
        keys.update(short_conv_keys(header, arch, config))
    if rules.has_mamba2:
        keys.update(mamba2_keys(header, arch, config))
    return keys


def _clamped_swiglu_keys(header: GGUFHeader, arch: str, config: dict, clamp: tuple[float, float]) -> dict:
    """gpt-oss's clamp as llama.cpp fixes it, its experts' count under HF's key."""
    keys = {"swiglu_alpha": clamp[0], "swiglu_limit": clamp[1]}
    return keys | ({"num_local_experts": config["num_experts"]} if config.get("num_experts") else {})


def num_draft_layers(header: GGUFHeader, arch: str) -> int:
    """The layers of a multi-token-prediction head (`nextn_predict_layers`), the file's last blocks."""
    meta = header.metadata
    count, num_blocks = meta.get(f"{arch}.nextn_predict_layers"), meta.get(f"{arch}.block_count")
    if count is None:
        return 0
    if isinstance(count, bool) or not isinstance(count, int) or not isinstance(num_blocks, int):
        raise ValueError(f"{header.path}: GGUF keys {arch}.nextn_predict_layers={count!r} and {arch}.block_count="
                         f"{num_blocks!r} must be integers")
    if not 0 <= count < num_blocks:
        raise ValueError(f"{header.path}: GGUF key {arch}.nextn_predict_layers={count} leaves no layers of the "
                         f"{num_blocks} blocks to the model")
    return count
