"""A checkpoint tensor's Hugging Face name to the model parameter, and the row block of a fused one, that it
fills (engine-core process): the one map the loader (coreserve/worker/models/loader.py) and new weights
(coreserve/worker/models/weight_update.py) read. Each family's names of the same tensor (LFM2's, Mixtral's,
Granite's, a vision-language folder's text prefix) meet here; a name this model has no place for is None.
"""

from __future__ import annotations

from coreserve.worker.models.config import DecoderArgs


def weight_destination(args: DecoderArgs, hf_name: str) -> tuple[str, slice | None] | None:
    """The parameter (and row block of a fused one) that an HF tensor fills; None: not this model's."""
    if args.text_prefix != "model." and hf_name.startswith(args.text_prefix):
        hf_name = "model." + hf_name[len(args.text_prefix):]
    top = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
           "model.embedding_norm.weight": "norm.weight"}  # LFM2's final norm
    if hf_name in top:
        return top[hf_name], None
    if hf_name == "lm_head.weight":  # a tied checkpoint may still carry it: HF ignores it, so do we
        return None if args.tie_word_embeddings else ("lm_head.weight", None)
    if hf_name == "score.weight" and args.num_labels:  # a *ForSequenceClassification's head
        return "score.weight", None
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and parts[3:] == ["layer_scalar"] and args.layers[0].has_layer_scalar:
        return f"layers.{parts[2]}.layer_scalar", None  # Gemma 4's, a tensor [1] of each layer
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    return _layer_destination(args, f"layers.{parts[2]}.", ".".join(parts[3:]))


def _layer_destination(args: DecoderArgs, prefix: str, rest: str) -> tuple[str, slice | None] | None:
    """A decoder layer's tensor (`rest`: its name after model.layers.N.) to its place under `prefix`."""
    q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    inter = args.intermediate_size
    q_rows = 2 * q_size if args.layers[0].has_output_gate else q_size  # q and its gate, a head's each
    fused = {
        "self_attn.q_proj": ("qkv_proj", slice(0, q_rows)),
        "self_attn.k_proj": ("qkv_proj", slice(q_rows, q_rows + kv_size)),
        "self_attn.v_proj": ("qkv_proj", slice(q_rows + kv_size, q_rows + 2 * kv_size)),
        "mlp.gate_proj": ("gate_up_proj", slice(0, inter)),
        "mlp.up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
        "feed_forward.w1": ("gate_up_proj", slice(0, inter)),  # LFM2's
        "feed_forward.w3": ("gate_up_proj", slice(inter, 2 * inter)),
        # Phi-3's checkpoints hold them fused already, in the same order (q, k, v; gate, up), Granite's MLP too
        "self_attn.qkv_proj": ("qkv_proj", None),
        "mlp.gate_up_proj": ("gate_up_proj", None),
        "shared_mlp.input_linear": ("gate_up_proj", None),
    }
    module, kind = rest.rsplit(".", 1)
    if args.linear is not None and module.split(".")[0] == "linear_attn":
        return _linear_attention_destination(args, prefix, module, kind)
    if args.short_conv is not None and module in ("conv.in_proj", "conv.conv", "conv.out_proj"):
        return prefix + f"{module}.{kind}", None
    if args.mamba is not None and module in _MAMBA2_MODULES:  # Granite's names are the model's own
        return prefix + f"{module}.{kind}", None
    if args.moe is not None and module.split(".")[0] in ("mlp", "block_sparse_moe"):
        expert = _expert_destination(args, module)
        if expert is not None:
            name, rows = expert
            return prefix + f"{name}.{kind}", rows
    if module in fused:
        name, rows = fused[module]
        return prefix + f"{name}.{kind}", rows
    if rest == "self_attn.sinks":  # gpt-oss's, a logit a head
        return prefix + "sinks", None
    plain = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj", "self_attn.q_norm": "q_norm",
             "self_attn.k_norm": "k_norm", "input_layernorm": "input_layernorm",
             # LFM2's names of the same
             "self_attn.out_proj": "o_proj", "feed_forward.w2": "down_proj", "self_attn.q_layernorm": "q_norm",
             "self_attn.k_layernorm": "k_norm", "operator_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "post_attention_layernorm": "post_attention_layernorm", "shared_mlp.output_linear": "down_proj",
             "pre_feedforward_layernorm": "pre_feedforward_layernorm",  # Gemma's sandwich
             "post_feedforward_layernorm": "post_feedforward_layernorm"}
    return (prefix + f"{plain[module]}.{kind}", None) if module in plain else None


def _linear_attention_destination(
    args: DecoderArgs, prefix: str, module: str, kind: str
) -> tuple[str, slice | None] | None:
    """A Gated DeltaNet layer's tensors: in_proj_qkv, _z, _b and _a fill one in_proj ([q k v | z | b | a]);
    Qwen3-Next's in_proj_qkvz and _ba fill its first and last rows (their groups undone: grouped_rows.py)."""
    assert args.linear is not None
    lin = args.linear
    conv, heads = lin.conv_dim, lin.num_value_heads
    z_end = conv + heads * lin.value_head_dim
    parts = {"in_proj_qkv": slice(0, conv), "in_proj_z": slice(conv, z_end),
             "in_proj_b": slice(z_end, z_end + heads), "in_proj_a": slice(z_end + heads, z_end + 2 * heads),
             "in_proj_qkvz": slice(0, z_end), "in_proj_ba": slice(z_end, z_end + 2 * heads)}
    name = module.split(".", 1)[1] if "." in module else ""
    if name in parts:
        return prefix + f"linear_attn.in_proj.{kind}", parts[name]
    if name in ("conv1d", "norm", "out_proj") or (name == "" and kind in ("dt_bias", "A_log")):
        return prefix + f"{module}.{kind}", None
    return None


# A Mamba2 layer's modules (their A_log, D and dt_bias are the layer's `mamba` module's own parameters)
_MAMBA2_MODULES = ("mamba", "mamba.in_proj", "mamba.conv1d", "mamba.norm", "mamba.out_proj")
# An expert's tensors by their names in each family's checkpoints (Mixtral's w1, w3, w2)
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _expert_destination(args: DecoderArgs, module: str) -> tuple[str, slice | None] | None:
    """A mixture's router (`mlp.gate`, Mixtral's `block_sparse_moe.gate`) and its experts' tensors
    (`mlp.experts.E.gate_proj`, ...): gate and up fill each expert's fused gate_up_proj, their biases (gpt-oss's
    GGUF experts, split per expert by coreserve/worker/models/gguf_weights.py) its bias's halves."""
    parts = module.split(".")
    if parts[1:] in (["gate"], ["shared_expert_gate"]):
        return f"moe.{parts[1]}", None
    if parts[1:] == ["router"]:  # gpt-oss's router, a bias beside its weight
        return "moe.gate", None
    if len(parts) == 3 and parts[1] == "shared_expert" and parts[2] in _EXPERT_PARTS:  # Qwen3-Next's
        assert args.moe is not None
        width, role = args.moe.shared_intermediate_size, _EXPERT_PARTS[parts[2]]
        rows = {"gate": slice(0, width), "up": slice(width, 2 * width), "down": None}[role]
        return "moe.shared_expert." + ("down_proj" if role == "down" else "gate_up_proj"), rows
    if len(parts) != 4 or parts[1] != "experts" or parts[3] not in _EXPERT_PARTS:
        return None
    assert args.moe is not None
    inter, role = args.moe.intermediate_size, _EXPERT_PARTS[parts[3]]
    target = f"moe.experts.{parts[2]}." + ("down_proj" if role == "down" else "gate_up_proj")
    rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": None}[role]
    return target, rows
