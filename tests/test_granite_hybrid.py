"""Granite 4.0-H (dense, `GraniteMoeHybridForCausalLM`) beyond the hybrid tests all families share
(tests/test_hybrid_models.py): its config (the Mamba2 shapes, the four multipliers, the shared MLP's width,
NoPE or RoPE, the hub's older layer names) and a RoPE variant of the random model against HF.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HF_TOLERANCE, IS_BF16_MODE, hf_logprobs, load_hf
from test_hybrid_models import BF16_TOLERANCE, GREEDY
from test_model_families import FAMILY_PROMPTS, _assert_prompt_logprobs

from coreserve import LLM
from coreserve.worker.models.config import DecoderArgs


def test_granite_config_reading(family_model):
    """Granite 4.0-H's config: the Mamba2 shapes (HF's defaults where absent), the four multipliers, the
    shared MLP's width, NoPE, the hub's older layer names; what is not built refused by name."""
    config = json.loads((Path(family_model("granitemoehybrid")) / "config.json").read_text())
    args = DecoderArgs.from_hf_config(config)
    mixer, attention = args.layers
    assert (mixer.mixer, attention.mixer) == ("mamba2", "attention") and args.intermediate_size == 96
    assert attention.attention.scale == 0.09 and attention.residual_multiplier == 0.6 and not args.is_llama_shaped
    assert (args.embedding_multiplier, args.logits_scaling, args.rope.rope_type) == (3.0, 1.6, "none")
    older = {k: v for k, v in config.items() if k != "layer_types"} | {"layers_block_type": ["mamba", "attention"]}
    assert DecoderArgs.from_hf_config(older).layers == args.layers
    assert DecoderArgs.from_hf_config({**config, "position_embedding_type": "rope"}).rope.rope_type == "default"
    hubs = {**config, "num_local_experts": 0, "num_experts_per_tok": 0}  # the hub's dense configs write both 0
    assert DecoderArgs.from_hf_config(hubs).layers == args.layers
    defaults = {k: v for k, v in config.items() if not k.startswith("mamba_")} | {"mamba_n_heads": 4}
    assert DecoderArgs.from_hf_config(defaults).mamba.state_size == 256  # HF's d_state, head_dim 128 / 4
    for change, message in [
        ({"num_local_experts": 4}, r"GraniteMoeHybrid with experts \(num_local_experts > 0\) is not built yet"),
        ({"num_local_experts": None}, "GraniteMoeHybrid with experts"),  # HF's default: 8
        ({"num_local_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok=0"),
        ({"mamba_n_groups": 3}, "not a multiple of mamba_n_groups"),
        ({"mamba_d_head": 8}, "must equal mamba_expand"),
        ({"mamba_d_state": 0}, "mamba_d_state"),
        ({"time_step_limit": [0.0, 10.0]}, "time_step_limit"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
        ({"mamba_conv_bias": "false"}, "mamba_conv_bias"),
        ({"residual_multiplier": -1.0}, "residual_multiplier"),
        ({"shared_intermediate_size": 0}, "shared_intermediate_size"),
        ({"layer_types": None}, "no attention layer"),  # HF's default: every layer a mamba layer
    ]:
        with pytest.raises(ValueError, match=message):
            DecoderArgs.from_hf_config({**config, **change})


def test_granite_with_rope_and_the_hubs_layer_names_matches_hf(family_model, tmp_path):
    """position_embedding_type "rope" (RoPE on the attention layers, as HF's) and the hub's `mamba` /
    `attention` layer names: prompt logprobs within 1e-4 of HF's on that folder."""
    source = Path(family_model("granitemoehybrid"))
    for item in source.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config |= {"position_embedding_type": "rope", "layer_types": ["mamba", "attention"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with LLM(str(tmp_path), multiprocess=False) as llm:
        outputs = llm.generate(FAMILY_PROMPTS[:2], GREEDY, use_tqdm=False)
    hf = load_hf(str(tmp_path))
    tolerance = BF16_TOLERANCE if IS_BF16_MODE else HF_TOLERANCE
    for output in outputs:
        _assert_prompt_logprobs(output, hf_logprobs(hf, output.prompt_token_ids), tolerance)
