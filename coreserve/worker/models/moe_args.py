"""A mixture of experts' arguments read from config.json (engine-core process): the experts, the top-k and its
renormalisation, the layers whose MLP stays dense (Qwen3-MoE's mlp_only_layers and sparse step), Qwen3-Next's
shared expert, gpt-oss's clamped SwiGLU; each number checked before the model is built. The mixture's math is
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
    )


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
