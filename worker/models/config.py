"""A Hugging Face config.json read into the model's arguments, for the families this engine runs
(Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, dense Phi-3/Phi-4, and the mixtures of experts Qwen3-MoE,
Mixtral and OLMoE), and refused with a ValueError where it asks for math the
engine does not do (engine-core process; the frontend reads nothing of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.models.rope import SUPPORTED_ROPE_TYPES, RopeSpec, long_rope_switch

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # dense Phi-3 / Phi-4: fused qkv_proj and gate_up_proj in the checkpoint
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention, experts behind a softmax top-k router
    "MixtralForCausalLM": "mixtral",  # Mistral's attention, top-k always renormalised
    "OlmoeForCausalLM": "olmoe",  # q/k norms over the whole projection, clip_qkv
    "Gemma2ForCausalLM": "gemma2",  # GemmaArgs: GeGLU, 1 + w norms around both halves, soft-caps
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3's text model: q/k norms, a RoPE base per layer kind
}
GEMMA_FAMILIES = ("gemma2", "gemma3")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
_MISTRAL_DEFAULT_WINDOW = 4096  # MistralConfig's default when config.json has no sliding_window key
# Keys of other architectures that change the math; any of them set (not null, not 0/False/1) is refused.
_REFUSED_KEYS = (
    "quantization_config",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "logits_scaling",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "num_experts",
    "num_local_experts",
    "shared_expert_intermediate_size",
)


@dataclass(frozen=True)
class GemmaArgs:
    """Gemma 2 and 3's departures from Llama: the embedding times sqrt(hidden) (rounded to the weights'
    dtype, as HF), RMSNorms that scale by 1 + weight, norms before and after attention and the MLP
    (the sandwich), GeGLU (gelu_pytorch_tanh), scores scaled by query_pre_attn_scalar ** -0.5 and
    soft-capped (Gemma 2), logits soft-capped (Gemma 2), local (sliding) and global layers."""

    embed_scale: float
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    layer_windows: tuple[int | None, ...]  # each layer's sliding window; None: a global layer
    rope_local: RopeSpec | None  # Gemma 3: the sliding layers' RoPE (rope_local_base_freq); None: one RoPE


@dataclass(frozen=True)
class MoeArgs:
    """A mixture-of-experts MLP: a softmax over the router's logits, the top_k experts of each token
    (their probabilities renormalised to sum to one where norm_topk_prob), each a SwiGLU MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (Qwen3-MoE's mlp_only_layers, sparse step)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    qkv_bias: bool
    o_bias: bool  # Llama/Qwen3 attention_bias=true: o_proj has one too
    has_qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before RoPE
    tie_word_embeddings: bool
    sliding_window: int | None  # Mistral: a token attends to itself and the window - 1 before it
    torch_dtype: str  # the checkpoint's dtype as config.json names it ("bfloat16", ...)
    qk_norm_whole: bool = False  # OLMoE: RMSNorm over all of q's and all of k's features, before RoPE
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip] after the norms
    moe: MoeArgs | None = None  # the mixtures of experts
    gemma: GemmaArgs | None = None  # Gemma 2 and 3

    def window_of(self, layer: int) -> int | None:
        return self.gemma.layer_windows[layer] if self.gemma is not None else self.sliding_window

    @property
    def is_llama_shaped(self) -> bool:
        """Whether decode_forward.c reads this model: none of the other families' departures."""
        return (
            self.moe is None and self.gemma is None and not self.qk_norm_whole and self.clip_qkv is None
            and self.rope.head_dim == self.head_dim  # every feature of a head rotates
        )

    @property
    def long_rope_switch(self) -> int | None:
        """LongRoPE's switch in tokens (worker/models/rope.py), for the scheduler's choice of factors per
        request; None without LongRoPE."""
        return long_rope_switch(self.rope)

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts, in order (the routed experts' layer axis)."""
        return [i for i in range(self.num_layers) if self.moe is not None and self.moe.is_sparse(i)]

    @classmethod
    def from_hf_config(cls, config: dict) -> LlamaArgs:
        family = model_family(config)
        _refuse_unsupported(config, family)
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        max_positions = config.get("max_position_embeddings", 2048)
        # HF's Mistral and Qwen2 have no such option (Qwen2: q/k/v biases always, o_proj none)
        attention_bias = family in ("llama", "qwen3", "qwen3_moe", "olmoe") and bool(config.get("attention_bias"))
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_positions,
            rope=rope_spec(_global_rope_config(config, family), head_dim, max_positions),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            has_qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            # Gemma's configs default to tied (a config.json may leave the key out)
            tie_word_embeddings=bool(config.get("tie_word_embeddings", family in GEMMA_FAMILIES)),
            sliding_window=_sliding_window(config, family),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            qk_norm_whole=family == "olmoe",
            clip_qkv=(config.get("clip_qkv") or None) if family == "olmoe" else None,
            moe=moe_args(config, family),
            gemma=gemma_args(config, family, head_dim, max_positions),
        )


def model_family(config: dict) -> str:
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in ARCHITECTURES:
            return ARCHITECTURES[architecture]
    raise ValueError(f"unsupported architecture {sorted(architectures)}; supported: {sorted(ARCHITECTURES)}")


def rope_spec(config: dict, head_dim: int, max_positions: int) -> RopeSpec:
    """Reads transformers 5's `rope_parameters` or the older `rope_scaling` + `rope_theta`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    head_dim = int(head_dim * partial)  # Phi-4-mini: the first 3/4 of each head rotate, HF's int()
    if head_dim % 2:
        raise ValueError(f"partial_rotary_factor={partial} leaves an odd rotary width {head_dim}")
    if rope_type in ("llama3", "yarn", "longrope"):  # HF: a top-level original_max_position_embeddings wins
        original = config.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or params.get(
            "original_max_position_embeddings", max_positions
        )
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params.get(key) or ()) != head_dim // 2:
                raise ValueError(f"RoPE type 'longrope' needs {key}: {head_dim // 2} values (rotary width / 2)")
    if rope_type not in ("default", "yarn", "longrope") and "factor" not in params:
        raise ValueError(f"RoPE type {rope_type!r} needs a `factor`")
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    for key in ("rope_type", "type"):
        params.pop(key, None)
    return RopeSpec(rope_type, float(theta), head_dim, max_positions, params)


def gemma_args(config: dict, family: str, head_dim: int, max_positions: int) -> GemmaArgs | None:
    if family not in GEMMA_FAMILIES:
        return None
    num_layers, window = config["num_hidden_layers"], config.get("sliding_window")
    kinds = config.get("layer_types")
    if not kinds:  # older configs: Gemma 2 alternates from a local layer; Gemma 3 has 5 local to 1 global
        pattern = 2 if family == "gemma2" else config.get("sliding_window_pattern", 6)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    params = config.get("rope_parameters") or {}
    rope_local = None
    if "sliding_attention" in params:  # transformers 5: one RoPE per kind of layer
        local = {**config, "rope_parameters": params["sliding_attention"]}
        rope_local = rope_spec(local, head_dim, max_positions)
    elif family == "gemma3":
        base = float(config.get("rope_local_base_freq", 10000.0))
        rope_local = RopeSpec("default", base, head_dim, max_positions, {})
    return GemmaArgs(
        embed_scale=config["hidden_size"] ** 0.5,
        attn_scale=float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=config.get("attn_logit_softcapping"),
        final_softcap=config.get("final_logit_softcapping"),
        layer_windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
        rope_local=rope_local,
    )


def _global_rope_config(config: dict, family: str) -> dict:
    """Gemma 3 in transformers 5 keeps a RoPE per kind of layer; the global layers' is the model's."""
    params = config.get("rope_parameters") or {}
    if family in GEMMA_FAMILIES and "full_attention" in params:
        return {**config, "rope_parameters": params["full_attention"]}
    return config


def moe_args(config: dict, family: str) -> MoeArgs | None:
    if family not in MOE_FAMILIES:
        return None
    num_layers = config["num_hidden_layers"]
    dense: tuple[int, ...] = ()
    if family == "qwen3_moe":  # HF: sparse where not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        step = config.get("decoder_sparse_step", 1) or 1
        only = set(config.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    inter = config["moe_intermediate_size"] if family == "qwen3_moe" else config["intermediate_size"]
    return MoeArgs(
        num_experts=config.get("num_experts") or config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        intermediate_size=inter,
        norm_topk_prob=family == "mixtral" or bool(config.get("norm_topk_prob", False)),
        dense_layers=dense,
    )


def _sliding_window(config: dict, family: str) -> int | None:
    if family == "mistral":
        return config.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    if family in ("phi3", "mixtral"):  # Phi-3-mini-4k's 2047; None in Phi3Config's and Mixtral's defaults
        return config.get("sliding_window")
    return None


def _refuse_unsupported(config: dict, family: str) -> None:
    if family in GEMMA_FAMILIES:
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={act!r} is not supported for {family} (only gelu_pytorch_tanh)")
        if config.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true (an encoder's attention) is not supported")
    elif config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported (only silu)")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true (biases in the MLP) is not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and family != "phi3":
        raise ValueError(f"partial_rotary_factor={partial} (RoPE on part of each head) is supported for Phi-3/4 only")
    if family in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window"):
        raise ValueError(f"{family} with use_sliding_window=true (per-layer windows) is not supported")
    layer_types = set(config.get("layer_types") or ["full_attention"])
    other = layer_types - {"full_attention"} - ({"sliding_attention"} if family in GEMMA_FAMILIES else set())
    if family != "mistral" and other:
        raise ValueError(f"layer_types {sorted(layer_types)} (mixed attention layers) are not supported")
    allowed = {"num_experts", "num_local_experts"} if family in MOE_FAMILIES else set()
    if family in GEMMA_FAMILIES:
        allowed = {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"}
    refused = [key for key in _REFUSED_KEYS if key not in allowed]
    if family in MOE_FAMILIES and config.get("num_experts_per_tok", 0) < 1:
        raise ValueError(f"{family}: num_experts_per_tok must be at least 1")
    for key in refused:
        if config.get(key) not in (None, 0, False, 1, 1.0):
            raise ValueError(f"config key {key}={config[key]!r} is not supported by this engine")
