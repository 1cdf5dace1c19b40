"""RoPE variants (coreserve/worker/models/rope.py) against Hugging Face's rotary embedding on the same config:
the cos/sin tables of every position, bit for bit, for default, linear, dynamic, llama3, yarn and
longrope (both of its sets of rows)."""

from __future__ import annotations

import pytest
import torch

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.rope import cos_sin_tables, long_rows_start

MAX_POSITIONS = 512
VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cos_sin_tables_equal_hf(variant):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS)
    hf_config = LlamaConfig(**fields, rope_parameters=dict(VARIANTS[variant]))
    positions = torch.arange(MAX_POSITIONS)[None, :]  # every position the engine may run
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, **fields, "rope_parameters": dict(VARIANTS[variant])}
    cos, sin = cos_sin_tables(DecoderArgs.from_hf_config(config).rope, MAX_POSITIONS)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=0)
    if variant != "default":
        default, _ = cos_sin_tables(
            DecoderArgs.from_hf_config({**config, "rope_parameters": VARIANTS["default"]}).rope, 64
        )
        assert variant == "dynamic" or not torch.allclose(default, cos[:64])  # the scaling does something


def test_longrope_tables_hold_hfs_short_rows_then_its_long_rows():
    """Phi-3's LongRoPE, switch at 64: the rows below long_rows_start are HF's for a sequence of up to
    64 tokens (short factors), the rows from it HF's for a longer one (long factors), bit for bit."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    switch, num_factors = 64, 32  # head_dim 64
    rope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + 0.05 * i for i in range(num_factors)],
        long_factor=[1.5 + 0.75 * i for i in range(num_factors)],
    )
    fields = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS)
    hf_rope = Phi3RotaryEmbedding(Phi3Config(**fields, original_max_position_embeddings=switch, rope_parameters=rope))
    x = torch.zeros(1, dtype=torch.float32)
    hf_short = hf_rope(x, torch.arange(switch)[None, :])  # seq_len 64: the short factors
    hf_long = hf_rope(x, torch.arange(MAX_POSITIONS)[None, :])  # seq_len 512 > 64: the long ones
    config = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, **fields, "original_max_position_embeddings": switch, "rope_parameters": rope}
    spec = DecoderArgs.from_hf_config(config).rope
    cos, sin = cos_sin_tables(spec, MAX_POSITIONS)
    start = long_rows_start(spec, MAX_POSITIONS)
    assert start == switch and cos.shape[0] == switch + MAX_POSITIONS
    for ours, theirs in ((cos[:start], hf_short[0]), (sin[:start], hf_short[1]), (cos[start:], hf_long[0]),
                         (sin[start:], hf_long[1])):
        torch.testing.assert_close(ours, theirs[0], rtol=0, atol=0)


def test_a_base_whose_angles_overflow_float32_is_refused_by_name():
    """OLMo 3's GGUF with rope.freq_base_swa = 1e-45 (the untrusted-input fuzzer): NaN tables, an internal
    RuntimeError before."""
    from coreserve.worker.models.rope import RopeSpec, Rotary

    with pytest.raises(ValueError, match="rope_theta=1e-45"):
        Rotary(RopeSpec("default", 1e-45, 16, 256))
