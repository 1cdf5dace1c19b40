"""The families this engine runs, one table entry each: what a family's config.json means beyond Llama's
(biases, q/k norms, windows, Gemma's norms and soft-caps, OLMo's norms on the outputs only, NoPE layers,
experts, recurrent mixers, Granite's multipliers), and the keys whose other values are refused by name
(Gemma 4's per-layer embeddings, KV sharing, experts), as rules that coreserve/worker/models/layer_spec.py and
config.py read (engine-core process).
The only place a family is named: a new family is an entry here, its weight names in the loaders, and its
tests.
"""

from __future__ import annotations

from dataclasses import dataclass

SILU, GELU_TANH = "silu", "gelu_pytorch_tanh"  # the gated MLP's activation: SwiGLU, GeGLU
FULL, SLIDING = "full_attention", "sliding_attention"  # config.json's layer_types
LINEAR = "linear_attention"  # a Gated DeltaNet layer (Qwen3.5): a recurrent state, no KV cache
CONV = "conv"  # a short convolution layer (LFM2): a conv state, no KV cache
# LayerSpec.mixer of those ("attention" else); MAMBA2: Granite 4.0-H's LINEAR layers
GATED_DELTANET, SHORT_CONV, MAMBA2 = "gated_deltanet", "short_conv", "mamba2"


@dataclass(frozen=True)
class MoeRule:
    """A mixture of experts: a softmax top-k router over SwiGLU experts."""

    width_key: str = "intermediate_size"  # the config key of each expert's width
    always_renormalises: bool = False  # Mixtral: the top-k renormalised whatever norm_topk_prob says
    has_sparse_step: bool = False  # Qwen3-MoE: decoder_sparse_step and mlp_only_layers make dense layers
    has_shared_expert: bool = False  # Qwen3-Next: a shared expert of shared_expert_intermediate_size beside the
    # routed ones, scaled by sigmoid(shared_expert_gate(x))
    # gpt-oss: router and experts with biases, the softmax over the top-k logits, the clamped SwiGLU
    # (swiglu_alpha, swiglu_limit), the experts fused in 3-D checkpoint tensors, gate and up interleaved
    is_clamped_swiglu: bool = False


@dataclass(frozen=True)
class Family:
    model_type: str
    always_qkv_bias: bool = False  # Qwen2: q/k/v biases whatever the config says, o_proj none
    reads_attention_bias: bool = False  # attention_bias=true: q/k/v and o_proj biases
    qk_norm: str | None = None  # "head": RMSNorm over each head of q and k; "whole": over all of q, of k
    has_clip_qkv: bool = False  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
    window: str = "none"  # "none"; "model": sliding_window for every layer; "layers": by layer_types
    default_window: int | None = None  # "model": the window where config.json has no sliding_window key
    layer_pattern: int = 1  # "layers" without layer_types: every pattern-th layer is global
    layer_pattern_key: str | None = None  # the config key that overrides layer_pattern
    layer_types: frozenset[str] | None = frozenset({FULL})  # the kinds allowed (None: any)
    refuses_use_sliding_window: bool = False  # Qwen2/3's per-layer windows, not built
    partial_rotary: bool = False  # partial_rotary_factor allowed (Phi-3/4)
    has_fused_checkpoint: bool = False  # qkv_proj and gate_up_proj fused in the checkpoint (Phi-3)
    activation: str = SILU
    norm_offset: float = 0.0  # RMSNorm scales by offset + weight (Gemma: 1)
    has_sandwich_norms: bool = False  # norms on attention's and the MLP's outputs too (Gemma)
    has_pre_norms: bool = True  # norms before attention and the MLP (OLMo 2/3, Exaone 4: none, their outputs' only)
    scales_embedding: bool = False  # the embedding times sqrt(hidden) (Gemma)
    has_softcaps: bool = False  # attention and final soft-caps, query_pre_attn_scalar (Gemma 2/3)
    rope_per_kind: bool = False  # rope_parameters may hold one RoPE per kind of layer (Gemma)
    # the sliding layers' own default RoPE where rope_parameters has none a kind: (the config key of its base,
    # HF's default base): Gemma 3's rope_local_base_freq; OLMo 3's none (HF gives rope_theta and rope_scaling to
    # the global layers alone, the sliding ones its default base)
    local_rope_base: tuple[str | None, float] | None = None
    nope: str = "none"  # NoPE layers: "listed" (SmolLM3's no_rope_layers), "global" (Exaone 4's, windows given)
    ties_by_default: bool = False  # tie_word_embeddings when config.json leaves it out
    moe: MoeRule | None = None
    recurrent: str | None = None  # the mixer of layer_types' `recurrent_layer` layers (GATED_DELTANET, ...)
    recurrent_layer: str = LINEAR  # the layer kind (layer_types' name) that is the recurrent mixer
    is_recurrent_by_default: bool = False  # no layer_types: every layer recurrent (Granite's HF default)
    kind_aliases: tuple[tuple[str, str], ...] = ()  # (older layer_types name, HF's): Granite's mamba, attention
    eps_key: str = "rms_norm_eps"  # the config key of the RMSNorms' epsilon (LFM2: norm_eps)
    adjusts_ff_dim: bool = False  # LFM2's block_auto_adjust_ff_dim: the MLP is 2/3 of intermediate_size, rounded
    key_aliases: tuple[tuple[str, str], ...] = ()  # (older key, HF's key): the older one wins where given, as in HF
    has_output_gate: bool = False  # attention's output times sigmoid(gate), gate beside q in q_proj (Qwen3.5)
    defaults: tuple[tuple[str, object], ...] = ()  # HF's config class defaults that differ from Llama's, where absent
    nests_text_config: bool = False  # config.json's text_config holds the decoder (a vision-language folder)
    # Granite: embedding_multiplier, residual_multiplier, attention_multiplier (the attention's scale) and
    # logits_scaling (HF's defaults 1); position_embedding_type (RoPE only where "rope")
    has_multipliers: bool = False
    mlp_width_key: str = "intermediate_size"  # the dense MLP's width (Granite: shared_intermediate_size)
    dense_only_key: str | None = None  # experts under this key (HF's default 8 where absent) not built yet
    has_sinks: bool = False  # a learned logit a head joins each attention softmax (gpt-oss)
    skipped_prefixes: tuple[str, ...] = ()  # a vision-language folder's tensors that are not the decoder's
    # Gemma 4: a fixed attention scale (1: q and k are normed), RMSNorm without a weight on each head of v,
    # each layer's output times its layer_scalar tensor, the last layer global whatever layer_types says (HF)
    attention_scale: float | None = None
    has_v_norm: bool = False
    has_layer_scalar: bool = False
    forces_last_global: bool = False
    has_final_softcap: bool = False  # final_logit_softcapping alone (Gemma 4: no attention soft-cap)
    # Gemma 4: the global layers' head size is global_head_dim (HF's default 512) or per_layer_config's, served
    # only where it is head_dim (one head size a model: its KV cache's)
    has_global_head_dim: bool = False
    # (key, HF's default where absent, the values served, what the others are): any other value refused by name
    served_only: tuple[tuple[str, object, tuple, str], ...] = ()
    # use_bidirectional_attention (EmbeddingGemma): every token attends to the whole prompt, within the
    # sliding layers' window either side; served by the pooling runner alone
    can_be_bidirectional: bool = False

    @property
    def served_keys(self) -> frozenset[str]:
        """The keys of served_only: refused there, by value, not elsewhere."""
        return frozenset(key for key, *_ in self.served_only)

    @property
    def allowed_keys(self) -> frozenset[str]:
        """Keys other families refuse that this one reads."""
        keys = {"num_experts", "num_local_experts"} if self.moe is not None else set()
        if self.moe is not None and self.moe.has_shared_expert:
            keys.add("shared_expert_intermediate_size")
        if self.has_softcaps:
            keys |= {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"}
        if self.has_final_softcap:
            keys.add("final_logit_softcapping")
        if self.moe is not None and self.moe.is_clamped_swiglu:
            keys |= {"swiglu_alpha", "swiglu_limit", "quantization_config"}  # gpt-oss's MXFP4 experts
        if self.has_multipliers:
            keys |= {"embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"}
        return frozenset(keys)


_QWEN3_5_DEFAULTS = (("head_dim", 256), ("partial_rotary_factor", 0.25))  # HF's Qwen3.5 / Qwen3-Next configs
_QWEN3_5 = dict(
    reads_attention_bias=True, qk_norm="head", layer_types=frozenset({FULL, LINEAR}), partial_rotary=True,
    norm_offset=1.0, recurrent=GATED_DELTANET, has_output_gate=True, skipped_prefixes=("model.visual.", "mtp."),
)
_GEMMA = dict(
    window="layers", layer_types=frozenset({FULL, SLIDING}), activation=GELU_TANH, norm_offset=1.0,
    has_sandwich_norms=True, scales_embedding=True, has_softcaps=True, rope_per_kind=True, ties_by_default=True,
    defaults=(("sliding_window", 4096),),  # HF's Gemma 2 and 3 config classes', where the key is absent
)
# Gemma 4's text decoder: Gemma 3's layers with norms scaling by weight (not 1 + weight), an unscaled norm on v,
# an attention scale of 1, a layer_scalar a layer, the global layers' proportional RoPE (HF's defaults where
# config.json has no rope_parameters); what it has beyond them refused by name
_GEMMA4_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}
_GEMMA4 = dict(
    window="layers", layer_types=frozenset({FULL, SLIDING}), layer_pattern=6, activation=GELU_TANH, qk_norm="head",
    has_sandwich_norms=True, scales_embedding=True, rope_per_kind=True, ties_by_default=True, attention_scale=1.0,
    has_v_norm=True, has_layer_scalar=True, forces_last_global=True, has_final_softcap=True, has_global_head_dim=True,
    defaults=(("sliding_window", 512), ("head_dim", 256), ("num_key_value_heads", 4), ("rope_parameters", _GEMMA4_ROPE)),
    skipped_prefixes=("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio."),
    served_only=(
        ("hidden_size_per_layer_input", 256, (0, None), "Gemma 4's per-layer embeddings"),
        ("num_kv_shared_layers", 0, (0, None), "Gemma 4's KV sharing across layers"),
        ("enable_moe_block", False, (False, None), "Gemma 4's mixture-of-experts blocks"),
        ("attention_k_eq_v", False, (False, None), "Gemma 4's keys as values (attention_k_eq_v)"),
        ("use_bidirectional_attention", None, (None, False, "vision"), "Gemma 4's bidirectional attention"),
    ),
)
_OLMO = dict(reads_attention_bias=True, qk_norm="whole", has_sandwich_norms=True, has_pre_norms=False)
# HF's gpt-oss RoPE where config.json names none
_GPT_OSS_YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)
# HF architecture -> its family
FAMILIES = {
    "LlamaForCausalLM": Family("llama", reads_attention_bias=True),
    "MistralForCausalLM": Family("mistral", window="model", default_window=4096, layer_types=None),
    "Qwen2ForCausalLM": Family("qwen2", always_qkv_bias=True, refuses_use_sliding_window=True),
    "Qwen3ForCausalLM": Family("qwen3", reads_attention_bias=True, qk_norm="head", refuses_use_sliding_window=True),
    # dense Phi-3 / Phi-4: fused qkv_proj and gate_up_proj; Phi-3-mini-4k's window 2047
    "Phi3ForCausalLM": Family("phi3", window="model", partial_rotary=True, has_fused_checkpoint=True),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe", reads_attention_bias=True, qk_norm="head", refuses_use_sliding_window=True,
        moe=MoeRule(width_key="moe_intermediate_size", has_sparse_step=True),
    ),
    "MixtralForCausalLM": Family("mixtral", window="model", moe=MoeRule(always_renormalises=True)),
    "OlmoeForCausalLM": Family("olmoe", reads_attention_bias=True, qk_norm="whole", has_clip_qkv=True, moe=MoeRule()),
    "Gemma2ForCausalLM": Family("gemma2", layer_pattern=2, **_GEMMA),
    "Gemma3ForCausalLM": Family(
        "gemma3", qk_norm="head", layer_pattern=6, layer_pattern_key="sliding_window_pattern",
        local_rope_base=("rope_local_base_freq", 10000.0), can_be_bidirectional=True, **_GEMMA,
    ),
    "Gemma4ForCausalLM": Family("gemma4", **_GEMMA4),
    "Gemma4ForConditionalGeneration": Family("gemma4", nests_text_config=True, **_GEMMA4),
    # OLMo 2: norms on attention's and the MLP's outputs only, q/k norms over the whole projections
    "Olmo2ForCausalLM": Family("olmo2", **_OLMO),
    # OLMo 3: OLMo 2's layers, three sliding-window layers in four; the global layers' RoPE scaling (YaRN) theirs
    "Olmo3ForCausalLM": Family(
        "olmo3", window="layers", layer_pattern=4, layer_types=frozenset({FULL, SLIDING}), rope_per_kind=True,
        local_rope_base=(None, 500000.0), defaults=(("rope_theta", 500000.0), ("sliding_window", 4096)),
        **_OLMO,
    ),
    # SmolLM3: Llama's layers, no RoPE where no_rope_layers[i] is 0 (every fourth layer by default), tied
    "SmolLM3ForCausalLM": Family(
        "smollm3", reads_attention_bias=True, refuses_use_sliding_window=True, nope="listed", ties_by_default=True,
        defaults=(("rope_theta", 2000000.0),),
    ),
    # Exaone 4: norms on the outputs only, per-head q/k norms; local layers (a window, RoPE) and global ones
    # (no window, and no RoPE where the model has windows)
    "Exaone4ForCausalLM": Family(
        "exaone4", qk_norm="head", has_sandwich_norms=True, has_pre_norms=False, window="layers", layer_pattern=4,
        layer_pattern_key="sliding_window_pattern", layer_types=frozenset({FULL, SLIDING}), nope="global",
        defaults=(("sliding_window", 4096),),
    ),
    # gpt-oss: sliding-window and full layers alternating, attention sinks, biases, YaRN; experts with biases
    # and a clamped SwiGLU, float or MXFP4 (its quantization_config: moe_args.py)
    "GptOssForCausalLM": Family(
        "gpt_oss", reads_attention_bias=True, window="layers", layer_pattern=2, layer_types=frozenset({FULL, SLIDING}),
        has_sinks=True, moe=MoeRule(is_clamped_swiglu=True),
        defaults=(("attention_bias", True), ("sliding_window", 128), ("head_dim", 64), ("rope_theta", 150000.0),
                  ("rope_scaling", _GPT_OSS_YARN), ("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072),
                  ("num_local_experts", 128), ("num_experts_per_tok", 4)),
    ),
    # Qwen3.5 (dense): three Gated DeltaNet layers in four, output-gated attention on a quarter of each head
    # rotated; its hub folders are vision-language ones, the decoder in text_config (the vision tower and
    # the multi-token-prediction head skipped by name: coreserve/worker/models/loader.py)
    "Qwen3_5ForCausalLM": Family("qwen3_5", defaults=_QWEN3_5_DEFAULTS, **_QWEN3_5),
    "Qwen3_5ForConditionalGeneration": Family(
        "qwen3_5", nests_text_config=True, defaults=_QWEN3_5_DEFAULTS, **_QWEN3_5,
    ),
    # Qwen3-Next: Qwen3.5's layers (its checkpoints interleave the Gated DeltaNet's projections a key head's
    # group at a time: coreserve/worker/models/grouped_rows.py) over a mixture of experts with a shared expert
    "Qwen3NextForCausalLM": Family(
        "qwen3_next", moe=MoeRule(width_key="moe_intermediate_size", has_sparse_step=True, has_shared_expert=True),
        defaults=(*_QWEN3_5_DEFAULTS, ("norm_topk_prob", True)), **_QWEN3_5,
    ),
    # LFM2: gated short convolutions (kernel conv_L_cache) beside attention with per-head q/k norms
    "Lfm2ForCausalLM": Family(
        "lfm2", qk_norm="head", layer_types=frozenset({FULL, CONV}), recurrent=SHORT_CONV, recurrent_layer=CONV,
        eps_key="norm_eps", adjusts_ff_dim=True, ties_by_default=True,
        key_aliases=(("block_ff_dim", "intermediate_size"), ("tie_embedding", "tie_word_embeddings")),
    ),
    # Granite 4.0-H (dense: 350M, 1B, micro): Mamba2 mixers beside a few attention layers, a SwiGLU shared_mlp
    # in every layer, four scalar multipliers, NoPE or RoPE; the mixtures (num_local_experts > 0) refused
    "GraniteMoeHybridForCausalLM": Family(
        "granitemoehybrid", reads_attention_bias=True, layer_types=frozenset({FULL, LINEAR}), recurrent=MAMBA2,
        is_recurrent_by_default=True, kind_aliases=(("mamba", LINEAR), ("attention", FULL)),
        key_aliases=(("layers_block_type", "layer_types"),), has_multipliers=True,
        mlp_width_key="shared_intermediate_size", dense_only_key="num_local_experts",
    ),
}


# The pooling models (runner="pooling", docs/serving.md "Pooling"): architecture -> (the causal family whose
# decoder it is, its head). "score": *ForSequenceClassification's linear head over the last non-pad token's
# hidden state (a classifier, or a reward model's one label); "none": the bare decoder (*Model), its final
# hidden states pooled (a sentence-transformers folder's embedding model). Their checkpoints have no lm_head.
POOLING_ARCHITECTURES = {
    "LlamaModel": ("LlamaForCausalLM", "none"),
    "LlamaForSequenceClassification": ("LlamaForCausalLM", "score"),
    "MistralModel": ("MistralForCausalLM", "none"),
    "MistralForSequenceClassification": ("MistralForCausalLM", "score"),
    "Qwen2Model": ("Qwen2ForCausalLM", "none"),
    "Qwen2ForSequenceClassification": ("Qwen2ForCausalLM", "score"),
    "Qwen3Model": ("Qwen3ForCausalLM", "none"),
    "Qwen3ForSequenceClassification": ("Qwen3ForCausalLM", "score"),
    "Gemma3TextModel": ("Gemma3ForCausalLM", "none"),
    "Gemma3TextForSequenceClassification": ("Gemma3ForCausalLM", "score"),
}


def head_of(config: dict) -> str:
    """The model's head: "lm_head" (a language model), "score" or "none" (POOLING_ARCHITECTURES)."""
    for architecture in config.get("architectures") or []:
        if architecture in FAMILIES:
            return "lm_head"
        if architecture in POOLING_ARCHITECTURES:
            return POOLING_ARCHITECTURES[architecture][1]
    family_of(config)  # the refusal naming what is supported
    raise AssertionError("unreachable")


def text_config(config: dict) -> dict:
    """The decoder's config: a vision-language folder's text_config (under the folder's architectures,
    with its tie_word_embeddings where only the outer level states it), else config.json itself with its
    older keys read as HF reads them (LFM2's block_ff_dim, tie_embedding), and the family's defaults where
    a key is absent (Qwen3-Next's norm_topk_prob: true)."""
    family = family_of(config)
    inner = config.get("text_config")
    _refuse_two_ropes(inner if family.nests_text_config and isinstance(inner, dict) else config)
    if not family.nests_text_config:
        aliased = {key: config[old] for old, key in family.key_aliases if old in config}
        return {**dict(family.defaults), **config, **aliased}
    if not isinstance(inner, dict):
        raise ValueError(f"{config.get('architectures')}: config.json needs a text_config object")
    merged = {**dict(family.defaults), **inner, "architectures": config["architectures"]}
    if "tie_word_embeddings" not in inner and "tie_word_embeddings" in config:
        merged["tie_word_embeddings"] = config["tie_word_embeddings"]
    return merged


def _refuse_two_ropes(config: dict) -> None:
    """rope_scaling beside a different rope_parameters, as config.json gives them (before the family's defaults):
    transformers lets the older rope_scaling win (and drops rope_parameters' theta), so neither reading is safe."""
    older, newer = config.get("rope_scaling"), config.get("rope_parameters")
    if older and newer and older != newer:
        raise ValueError("rope_scaling and rope_parameters both given and different: transformers lets the older "
                         "rope_scaling override rope_parameters (and drops its rope_theta); give one of them")


def refuse_unserved(config: dict, family: Family) -> None:
    """What the family's HF class holds beyond the layers this engine builds, refused by name (HF's default
    where absent); Gemma 4's global layers' own head size (global_head_dim, per_layer_config) too."""
    for key, default, served, what in family.served_only:
        value = config.get(key, default)
        if value not in served:  # HF reads these by truth: 0 and False are alike
            raise ValueError(f"{what}: not supported ({key}={value!r})")
    if not family.has_global_head_dim:
        return
    head_dim, kv_heads = config.get("head_dim"), config.get("num_key_value_heads")
    overrides = config.get("per_layer_config")
    if overrides is None:  # HF: the global layers' head_dim is global_head_dim, 512 where absent
        overrides = {"global": {"head_dim": config.get("global_head_dim", 512)}}
    base = {"head_dim": head_dim, "num_key_value_heads": kv_heads}
    for layer, changed in (overrides.items() if isinstance(overrides, dict) else [("?", overrides)]):
        if not isinstance(changed, dict) or any(base.get(key, object()) != value for key, value in changed.items()):
            raise ValueError(f"Gemma 4's per-layer attention shapes (layer {layer}: {str(changed)[:80]}, "
                             f"head_dim={head_dim}) are not supported: global_head_dim must be head_dim")


def family_of(config: dict) -> Family:
    """The family of config.json's first supported architecture; ValueError where none is."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ValueError(f"architectures={str(architectures)[:100]} must be a list of class names")
    for architecture in architectures:
        if architecture in FAMILIES:
            return FAMILIES[architecture]
        if architecture in POOLING_ARCHITECTURES:
            return FAMILIES[POOLING_ARCHITECTURES[architecture][0]]
    supported = sorted([*FAMILIES, *POOLING_ARCHITECTURES])
    raise ValueError(f"unsupported architecture {sorted(architectures)}; supported: {supported}")
