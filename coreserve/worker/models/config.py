"""A Hugging Face config.json read into the model's arguments, for the families of
coreserve/worker/models/family.py's table (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, dense Phi-3/Phi-4, Gemma
2, 3 and 4, OLMo 2 and 3, SmolLM3, Exaone 4, the mixtures of experts Qwen3-MoE, Mixtral and OLMoE, and the hybrids
Qwen3.5, Qwen3-Next, LFM2 and Granite 4.0-H): the model's shapes, and one frozen `LayerSpec` a layer
(coreserve/worker/models/layer_spec.py), built here once; refused with a ValueError where config.json asks for
math the engine does not do (engine-core process; the frontend reads nothing of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from coreserve.worker.models.config_checks import check_config_numbers
from coreserve.worker.models.family import (
    FAMILIES,
    GATED_DELTANET,
    GELU_TANH,
    MAMBA2,
    SHORT_CONV,
    SILU,
    Family,
    family_of,
    head_of,
    refuse_unserved,
    text_config,
)
from coreserve.worker.models.layer_spec import (
    LayerSpec,
    global_rope_config,
    layer_kinds,
    layer_specs,
    multiplier,
    rope_spec,
)
from coreserve.worker.models.moe_args import MoeArgs, moe_args
from coreserve.worker.models.recurrent_args import (
    LinearAttentionArgs,
    Mamba2Args,
    ShortConvArgs,
    linear_attention_args,
    mamba2_args,
    short_conv_args,
)
from coreserve.worker.models.rope import NO_ROPE, RopeSpec, long_rope_switch

# Keys of other architectures that change the math; any of them set (not null, not 0/False/1) is refused
# unless the family reads it (Family.allowed_keys).
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
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec  # the model's (the global layers'); a layer's own is layers[i].rope
    qkv_bias: bool
    o_bias: bool  # attention_bias=true: o_proj has one too
    tie_word_embeddings: bool
    torch_dtype: str  # the checkpoint's dtype as config.json names it ("bfloat16", ...)
    layers: tuple[LayerSpec, ...]  # each decoder layer's
    norm_offset: float = 0.0  # the final norm's, as the layers' (Gemma: 1 + weight)
    embed_scale: float | None = None  # the embedding times it, rounded to the weights' dtype (Gemma)
    final_softcap: float | None = None  # logits become cap tanh(logit / cap) (Gemma 2)
    moe: MoeArgs | None = None  # the mixtures of experts
    linear: LinearAttentionArgs | None = None  # the Gated DeltaNet layers' shapes (Qwen3.5)
    short_conv: ShortConvArgs | None = None  # the short convolution layers' (LFM2)
    mamba: Mamba2Args | None = None  # the Mamba2 layers' (Granite 4.0-H)
    embedding_multiplier: float | None = None  # Granite: the embedding times it (a Python float, as HF)
    logits_scaling: float | None = None  # Granite: the logits divided by it
    # A vision-language folder's decoder tensors are under "model.language_model." (read as "model.");
    # tensors under skipped_prefixes (its vision tower, a multi-token-prediction head) are not this model's
    text_prefix: str = "model."
    skipped_prefixes: tuple[str, ...] = ()
    # "lm_head" (a language model), "score" (a *ForSequenceClassification: `score` [num_labels, hidden]) or
    # "none" (a bare decoder): family.py's POOLING_ARCHITECTURES
    head: str = "lm_head"
    num_labels: int = 0  # the score head's outputs (config.json's id2label); 0: no score head

    @property
    def is_bidirectional(self) -> bool:
        """Some layer attends both ways (EmbeddingGemma): only the pooling runner serves it."""
        return any(not spec.attention.is_causal for spec in self.layers)

    @property
    def attention_layers(self) -> list[int]:
        """The layers with a KV cache, in order (a hybrid's recurrent layers keep a state instead)."""
        return [i for i, spec in enumerate(self.layers) if spec.mixer == "attention"]

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state a sequence (the state cache: coreserve/worker/kv_memory.py)."""
        return len(self.attention_layers) != self.num_layers

    @property
    def state_bytes_per_seq(self) -> int:
        """A running sequence's recurrent state over every recurrent layer (0: not a hybrid)."""
        per_layer = {GATED_DELTANET: self.linear.state_bytes if self.linear else 0,
                     SHORT_CONV: self.short_conv.state_bytes(self.hidden_size) if self.short_conv else 0,
                     MAMBA2: self.mamba.state_bytes if self.mamba else 0}
        return sum(per_layer.get(spec.mixer, 0) for spec in self.layers)

    @property
    def is_llama_shaped(self) -> bool:
        """Whether decode_forward.c reads this model: every layer computes what it does, on one RoPE
        that rotates every feature of a head, or none (SmolLM3's NoPE layers)."""
        return (
            all(s.is_llama_shaped and (s.rope == self.rope or s.rope.rope_type == NO_ROPE) for s in self.layers)
            and self.embed_scale is None and self.final_softcap is None and not self.norm_offset
            and self.moe is None and self.rope.head_dim == self.head_dim and self.rope.rope_type != NO_ROPE
            and self.embedding_multiplier is None and self.logits_scaling is None
        )

    @property
    def long_rope_switch(self) -> int | None:
        """LongRoPE's switch in tokens (coreserve/worker/models/rope.py), for the scheduler's choice of factors per
        request; None without LongRoPE."""
        return long_rope_switch(self.rope)

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts, in order (the routed experts' layer axis)."""
        return [i for i, spec in enumerate(self.layers) if spec.is_moe]

    @classmethod
    def from_hf_config(cls, config: dict) -> DecoderArgs:
        config = text_config(config)
        check_config_numbers(config)
        family = family_of(config)
        _refuse_unsupported(config, family)
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        max_positions = config.get("max_position_embeddings", 2048)
        attention_bias = family.reads_attention_bias and bool(config.get("attention_bias"))
        rope = rope_spec(global_rope_config(config, family), head_dim, max_positions)
        if family.has_multipliers and config.get("position_embedding_type") != "rope":  # HF: RoPE only then
            rope = RopeSpec(NO_ROPE, rope.theta, head_dim, max_positions)
        moe = moe_args(config, family)
        layers = layer_specs(config, family, rope, moe.dense_layers if moe else (), head_dim, max_positions)
        if all(spec.mixer != "attention" for spec in layers):
            raise ValueError("a model with no attention layer (every layer recurrent) is not supported")
        head = head_of(config)
        local = [s.rope for s in layers if s.rope is not rope]
        if local and "longrope" in (rope.rope_type, local[0].rope_type):  # both tables read at one row
            raise ValueError("RoPE 'longrope' in a model with a RoPE per kind of layer is not supported")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=_intermediate_size(config, family),
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get(family.eps_key, 1e-6),
            max_position_embeddings=max_positions,
            rope=rope,
            qkv_bias=family.always_qkv_bias or attention_bias,
            o_bias=attention_bias,
            # a pooling model has no lm_head: tied, it takes no memory and no tensor of the file (never read)
            tie_word_embeddings=head != "lm_head" or bool(config.get("tie_word_embeddings", family.ties_by_default)),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            layers=layers,
            norm_offset=family.norm_offset,
            embed_scale=config["hidden_size"] ** 0.5 if family.scales_embedding else None,
            final_softcap=config.get("final_logit_softcapping") if "final_logit_softcapping" in family.allowed_keys else None,
            moe=moe,
            linear=linear_attention_args(config) if family.recurrent == GATED_DELTANET else None,
            short_conv=short_conv_args(config) if family.recurrent == SHORT_CONV else None,
            mamba=mamba2_args(config) if family.recurrent == MAMBA2 else None,
            embedding_multiplier=_multiplier(config, family, "embedding_multiplier"),
            logits_scaling=_multiplier(config, family, "logits_scaling"),
            text_prefix=_text_prefix(family, head),
            skipped_prefixes=family.skipped_prefixes,
            head=head,
            num_labels=num_labels(config) if head == "score" else 0,
        )


def _text_prefix(family: Family, head: str) -> str:
    """Where the decoder's tensors are in the checkpoint: a bare *Model's names have no prefix."""
    if head == "none":
        return ""
    return "model.language_model." if family.nests_text_config else "model."


MAX_LABELS = 1 << 16  # a classifier's labels: far more than any has


def num_labels(config: dict) -> int:
    """A classifier's label count as HF reads it: id2label's size (keys 0..n-1), else num_labels, else 2."""
    id2label = config.get("id2label")
    if id2label is None:
        count = config.get("num_labels", 2)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_LABELS:
            raise ValueError(f"num_labels={str(count)[:40]} must be an integer in 1..{MAX_LABELS}")
        return count
    if not isinstance(id2label, dict) or not 1 <= len(id2label) <= MAX_LABELS:
        raise ValueError(f"id2label must be an object of 1..{MAX_LABELS} labels, got {str(id2label)[:80]}")
    if sorted(id2label) != sorted(str(i) for i in range(len(id2label))):
        raise ValueError(f"id2label's keys must be 0..{len(id2label) - 1}, got {sorted(id2label)[:8]}")
    return len(id2label)


def _multiplier(config: dict, family: Family, key: str) -> float | None:
    """Granite's model-wide multiplier `key`; None: none (another family, or 1)."""
    value = multiplier(config, key) if family.has_multipliers else 1.0
    return None if value == 1 else value


def _intermediate_size(config: dict, family: Family) -> int:
    """The MLP's width; LFM2's auto-adjusted one as HF computes it (2/3, times the multiplier, rounded up to
    block_multiple_of); Granite's shared_mlp's (HF's default 1024)."""
    size = config.get(family.mlp_width_key, 1024)
    if family.mlp_width_key != "intermediate_size" and (isinstance(size, bool) or not isinstance(size, int)
                                                        or not 1 <= size <= 1 << 20):
        raise ValueError(f"{family.mlp_width_key}={size!r} must be an integer in 1..{1 << 20}")
    if not (family.adjusts_ff_dim and config.get("block_auto_adjust_ff_dim", True)):
        return size
    size = int(2 * size / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = config.get("block_multiple_of", 256)
        if isinstance(multiple, bool) or not isinstance(multiple, int) or not 1 <= multiple <= 1 << 16:
            raise ValueError(f"block_multiple_of={multiple!r} must be an integer in 1..65536")
        if not isinstance(multiplier, (int, float)) or not 0 < multiplier <= 64:
            raise ValueError(f"block_ffn_dim_multiplier={multiplier!r} must be a number in (0, 64]")
        size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    if size < 1:
        raise ValueError(f"intermediate_size={config['intermediate_size']} leaves no MLP after LFM2's adjustment")
    return size


def _refuse_unsupported(config: dict, family: Family) -> None:
    name = family.model_type
    refuse_unserved(config, family)
    if family.activation == GELU_TANH:
        act = config.get("hidden_activation") or config.get("hidden_act") or GELU_TANH
        if act != GELU_TANH:
            raise ValueError(f"hidden_activation={act!r} is not supported for {name} (only {GELU_TANH})")
        is_served = family.can_be_bidirectional or "use_bidirectional_attention" in family.served_keys
        if config.get("use_bidirectional_attention") and not is_served:
            raise ValueError("use_bidirectional_attention=true (an encoder's attention) is not supported")
    elif config.get("hidden_act", SILU) != SILU:
        raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported (only silu)")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true (biases in the MLP) is not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not family.partial_rotary:
        raise ValueError(f"partial_rotary_factor={partial} (RoPE on part of each head) is supported for Phi-3/4, "
                         "Qwen3.5 and Qwen3-Next only")
    if family.dense_only_key is not None and config.get(family.dense_only_key, 8) != 0:  # HF's default: 8
        architecture = next(a for a in config["architectures"] if FAMILIES.get(a) is family)
        raise ValueError(f"{architecture.removesuffix('ForCausalLM')} with experts ({family.dense_only_key} > 0) "
                         "is not built yet")
    position = config.get("position_embedding_type")
    if family.has_multipliers and position not in (None, "nope", "rope"):
        raise ValueError(f"position_embedding_type={position!r} is not supported (\"rope\", or \"nope\" / null)")
    if family.refuses_use_sliding_window and config.get("use_sliding_window"):
        raise ValueError(f"{name} with use_sliding_window=true (per-layer windows) is not supported")
    layer_types = set(layer_kinds(config, family))
    if family.layer_types is not None and layer_types - family.layer_types:
        raise ValueError(f"layer_types {sorted(layer_types)} (mixed attention layers) are not supported")
    if family.moe is not None and config.get("num_experts_per_tok") == 0:  # 0 is "none" only without experts
        raise ValueError(f"{name}: num_experts_per_tok must be at least 1")
    for key in _REFUSED_KEYS:
        if key not in family.allowed_keys and config.get(key) not in (None, 0, False, 1, 1.0):
            raise ValueError(f"config key {key}={config[key]!r} is not supported by this engine")

