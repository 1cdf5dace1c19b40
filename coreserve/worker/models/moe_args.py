"""A mixture of experts' arguments read from config.json (engine-core process): the experts, the top-k and its
renormalisation, the layers whose MLP stays dense (Qwen3-MoE's mlp_only_layers and sparse step), Qwen3-Next's
shared expert, gpt-oss's clamped SwiGLU and its MXFP4 experts (quantization_config); each number checked before
the model is built. The mixture's math is
coreserve/worker/models/moe.py's; config.py's `DecoderArgs` holds one `MoeArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from coreserve.worker.models.family import Family


@dataclass(frozen=True)
class MoeArgs:
    """A mixture-of-experts MLP: a softmax over the router's logits, the top_k experts of each token
    (their probabilities renormalised to sum to one where norm_topk_prob), each a SwiGLU MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (Qwen3-MoE's mlp_only_layers, sparse step)
    shared_intermediate_size: int = 0  # Qwen3-Next's shared expert's width, its output gated by a sigmoid; 0: none
    # gpt-oss's clamped SwiGLU (swiglu_alpha, swiglu_limit), its router and experts with biases, the softmax
    # over the top-k logits; None: SwiGLU experts without biases, the top-k of the softmax
    clamped_swiglu: tuple[float, float] | None = None
    is_mxfp4: bool = False  # gpt-oss's experts in MXFP4 `_blocks` and `_scales` (coreserve/worker/models/mxfp4_experts.py)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers



def moe_args(config: dict, family: Family) -> MoeArgs | None:
    rule = family.moe
    if rule is None:
        return None
    num_layers = config["num_hidden_layers"]
    dense: tuple[int, ...] = ()
    if rule.has_sparse_step:  # HF: sparse where not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        step = config.get("decoder_sparse_step", 1) or 1
        only = config.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ValueError(f"mlp_only_layers={str(only)[:100]} must be a list of layer indices")
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if not num_experts:
        raise ValueError(f"{family.model_type}: a mixture needs num_experts (or num_local_experts) of 1 or more")
    return MoeArgs(
        num_experts=num_experts,
        top_k=_moe_number(config, "num_experts_per_tok"),
        intermediate_size=_moe_number(config, rule.width_key),
        norm_topk_prob=rule.always_renormalises or bool(config.get("norm_topk_prob", False)),
        dense_layers=dense,
        shared_intermediate_size=_shared_expert_width(config) if rule.has_shared_expert else 0,
        clamped_swiglu=_clamped_swiglu(config) if rule.is_clamped_swiglu else None,
        is_mxfp4=rule.is_clamped_swiglu and _is_mxfp4(config.get("quantization_config"), config, rule.width_key),
    )


# transformers' Mxfp4Config for gpt-oss: the modules it may leave unquantized (the hub's list); none is an expert
_MXFP4_UNCONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")


def _is_mxfp4(quantization: object, config: dict, width_key: str) -> bool:
    """Whether gpt-oss's quantization_config puts its experts in MXFP4 (what transformers' Mxfp4Config writes:
    quant_method "mxfp4", modules_to_not_convert among the non-expert modules); anything else refused by name, and
    widths that are not whole blocks of 32 (the experts' inputs: hidden_size and theirs)."""
    if quantization is None:
        return False
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "mxfp4":
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"quantization_config.quant_method={str(method)[:100]!r} is not supported for gpt_oss "
                         "(only mxfp4: the hub's MXFP4 experts)")
    unknown = sorted(set(quantization) - {"quant_method", "modules_to_not_convert"})
    if unknown:
        raise ValueError(f"quantization_config.{unknown[0][:100]} is not supported (mxfp4 reads quant_method and "
                         "modules_to_not_convert)")
    kept = quantization.get("modules_to_not_convert") or []
    others = [m for m in kept if m not in _MXFP4_UNCONVERTED] if isinstance(kept, list) else [kept]
    if others:
        raise ValueError(f"quantization_config.modules_to_not_convert entry {str(others[0])[:100]!r} is not "
                         f"supported: every layer's experts are MXFP4, nothing else is ({list(_MXFP4_UNCONVERTED)})")
    for key in ("hidden_size", width_key):  # ranges checked before (check_config_numbers)
        if config[key] % 32:
            raise ValueError(f"{key}={config[key]} is not a multiple of 32: MXFP4 experts hold blocks of 32 inputs")
    return True


def _clamped_swiglu(config: dict) -> tuple[float, float]:
    """gpt-oss's (swiglu_alpha, swiglu_limit), HF's defaults where absent (ranges: check_config_numbers)."""
    values = {key: config.get(key, default) for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0))}
    for key, value in values.items():
        if value is None:  # HF's clamp would have no bound
            raise ValueError(f"{key}=null: gpt-oss's clamped SwiGLU needs a positive number")
    return float(values["swiglu_alpha"]), float(values["swiglu_limit"])


def _moe_number(config: dict, *keys: str) -> int:
    """The first of `keys` the config has (its range and relations checked by check_config_numbers)."""
    found = [config[key] for key in keys if config.get(key) is not None]
    if not found:
        raise ValueError(f"the config of a mixture of experts has no {' or '.join(keys)}")
    return found[0]


def _shared_expert_width(config: dict) -> int:
    width = config.get("shared_expert_intermediate_size")
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 1 << 20:
        raise ValueError(f"shared_expert_intermediate_size={width!r} must be an integer in 1..{1 << 20}")
    return width
