"""The families as one table (coreserve/worker/models/family.py, and gguf_config.py's GGUF_ARCHS): no family
named in a comparison anywhere in coreserve/worker/, and each layer's frozen spec read from config.json once."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.family import FAMILIES, GELU_TANH, SILU
from coreserve.worker.models.gguf_config import GGUF_ARCHS
from coreserve.worker.step.attention import AttentionSpec

ROOT = Path(__file__).resolve().parent.parent
FAMILY_NAMES = (
    {family.model_type for family in FAMILIES.values()}
    | set(GGUF_ARCHS) | {rules.model_type for rules in GGUF_ARCHS.values()} | {"gemma", "phi", "qwen"}
)


def _names_a_family(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in FAMILY_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_family(element) for element in node.elts)
    return False


def family_tests(source: str) -> list[int]:
    """The lines of `x == "gemma2"`, `x in ("qwen3", ...)`, `x.startswith("gemma")` in one module's
    source: where it branches on a family's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(_names_a_family, [node.left, *node.comparators])):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith") and any(map(_names_a_family, node.args)):
                found.append(node.lineno)
    return found


def test_no_module_branches_on_a_family_name():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "coreserve" / "worker").rglob("*.py"))
        for line in family_tests(path.read_text())
    ]
    assert not found, f"a family named outside its table entry: {found}"


def test_the_guard_sees_a_family_comparison():
    source = 'if family in ("qwen3", "olmoe") or arch.startswith("gemma") or t == "phi3":\n    pass\n'
    assert family_tests(source) == [1, 1, 1]


def _config(family_model, family: str) -> dict:
    import json

    return json.loads((Path(family_model(family)) / "config.json").read_text())


def test_gemma2_layers_alternate_local_and_global_with_the_sandwich_and_geglu(family_model):
    args = DecoderArgs.from_hf_config(_config(family_model, "gemma2"))
    local, full = args.layers
    assert local.attention == AttentionSpec(window=24, scale=24**-0.5, softcap=5.0)
    assert full.attention == AttentionSpec(window=None, scale=24**-0.5, softcap=5.0)
    assert local.has_sandwich_norms and local.norm_offset == 1.0 and local.activation == GELU_TANH
    assert args.final_softcap == 8.0 and args.embed_scale == args.hidden_size**0.5 and not args.is_llama_shaped


def test_gemma3_local_layers_take_their_own_rope(family_model):
    args = DecoderArgs.from_hf_config(_config(family_model, "gemma3"))
    local, full = args.layers
    assert full.rope == args.rope and args.rope.rope_type == "linear"
    assert local.rope != args.rope and local.rope.theta == 10000.0 and local.qk_norm == "head"


@pytest.mark.parametrize("family", ["mistral", "phi3", "mixtral"])
def test_one_window_families_give_every_layer_the_window(family, family_model):
    args = DecoderArgs.from_hf_config(_config(family_model, family))
    assert {spec.attention for spec in args.layers} == {AttentionSpec(window=24)}
    assert all(spec.activation == SILU and not spec.has_sandwich_norms for spec in args.layers)


def test_qwen3_moe_dense_layers_are_in_the_spec(family_model):
    args = DecoderArgs.from_hf_config(_config(family_model, "qwen3_moe"))
    assert [spec.is_moe for spec in args.layers] == [True, False] and args.moe_layers == [0]


def test_layer_specs_are_frozen(family_model):
    spec = DecoderArgs.from_hf_config(_config(family_model, "llama2")).layers[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.is_moe = True  # type: ignore[misc]


def _small(architecture: str, **keys) -> dict:
    """A config.json of `architecture` at the test models' size, `keys` over it (no weights: the spec alone)."""
    return {"architectures": [architecture], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, **keys}


def test_olmo3_norms_the_outputs_only_and_its_sliding_layers_take_their_own_rope(family_model):
    args = DecoderArgs.from_hf_config(_config(family_model, "olmo3"))
    local, full = args.layers
    assert local.attention == AttentionSpec(window=24) and full.attention == AttentionSpec(window=None)
    assert full.rope == args.rope and args.rope.rope_type == "yarn" and args.rope.theta == 500000.0
    assert local.rope.rope_type == "default" and local.rope.theta == 10000.0
    assert all(s.has_sandwich_norms and not s.has_pre_norms and s.qk_norm == "whole" for s in args.layers)
    assert not args.is_llama_shaped


def test_olmo3_older_config_keeps_its_rope_scaling_to_the_global_layers():
    """rope_scaling + rope_theta (the hub's Olmo-3 configs): HF gives both to the full_attention layers alone,
    the sliding ones its default RoPE (base 500000 whatever rope_theta says); without layer_types three sliding
    layers in four, the window HF's default 4096."""
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
    args = DecoderArgs.from_hf_config(_small("Olmo3ForCausalLM", rope_scaling=yarn, rope_theta=10000.0))
    assert [s.attention.window for s in args.layers] == [4096, 4096, 4096, None]
    assert args.layers[3].rope == args.rope and (args.rope.rope_type, args.rope.theta) == ("yarn", 10000.0)
    assert {(s.rope.rope_type, s.rope.theta) for s in args.layers[:3]} == {("default", 500000.0)}
    olmo2 = DecoderArgs.from_hf_config(_small("Olmo2ForCausalLM", sliding_window=8))  # no windows in OLMo 2
    assert {s.attention.window for s in olmo2.layers} == {None} and olmo2.rope.theta == 10000.0


def test_smollm3_layers_listed_0_in_no_rope_layers_take_no_rope():
    args = DecoderArgs.from_hf_config(_small("SmolLM3ForCausalLM", no_rope_layers=[1, 0, 1, 1]))
    assert [s.rope.rope_type for s in args.layers] == ["default", "none", "default", "default"]
    assert args.rope.theta == 2000000.0 and args.tie_word_embeddings
    assert args.is_llama_shaped  # the fused decode step takes its NoPE layers
    by_interval = DecoderArgs.from_hf_config(_small("SmolLM3ForCausalLM", no_rope_layer_interval=2))
    assert [s.rope.rope_type for s in by_interval.layers] == ["default", "none", "default", "none"]


def test_exaone4_global_layers_take_no_rope_where_the_model_has_windows():
    args = DecoderArgs.from_hf_config(_small("Exaone4ForCausalLM"))  # HF's defaults: window 4096, pattern 4
    assert [(s.attention.window, s.rope.rope_type) for s in args.layers] == [(4096, "default")] * 3 + [(None, "none")]
    assert all(s.qk_norm == "head" and not s.has_pre_norms and s.has_sandwich_norms for s in args.layers)
    unwindowed = _small("Exaone4ForCausalLM", sliding_window=None, layer_types=["full_attention"] * 4)
    assert {(s.attention.window, s.rope.rope_type) for s in DecoderArgs.from_hf_config(unwindowed).layers} == {
        (None, "default")}


def test_gpt_oss_takes_hfs_defaults_where_its_keys_are_absent():
    """HF's GptOssConfig: sliding and full layers alternating, window 128, YaRN (factor 32 over 4096 positions,
    base 150000), q/k/v/o biases, sinks, 128 experts top 4, the clamped SwiGLU's alpha 1.702 and limit 7."""
    args = DecoderArgs.from_hf_config(_small("GptOssForCausalLM"))
    assert [s.attention.window for s in args.layers] == [128, None, 128, None]
    assert (args.moe.num_experts, args.moe.top_k, args.rms_norm_eps, args.max_position_embeddings) == (
        128, 4, 1e-5, 131072)
    assert (args.rope.rope_type, args.rope.theta, args.rope.params["factor"]) == ("yarn", 150000.0, 32.0)
    assert args.rope.params["original_max_position_embeddings"] == 4096 and not args.rope.params["truncate"]
    assert args.qkv_bias and args.o_bias and args.head_dim == 64 and all(s.has_sinks for s in args.layers)
    assert args.moe.clamped_swiglu == (1.702, 7.0) and not args.is_llama_shaped


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_gemma_without_a_sliding_window_key_takes_hfs_default(architecture):
    """HF's Gemma 2 and 3 config classes default sliding_window to 4096 where the key is absent."""
    args = DecoderArgs.from_hf_config(_small(architecture, head_dim=16, layer_types=None))
    assert {s.attention.window for s in args.layers} - {None} == {4096}  # a local layer at least


@pytest.mark.parametrize(
    "architecture, keys, message",
    [
        ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}, "no_rope_layers"),
        ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
        ("SmolLM3ForCausalLM", {"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
        ("SmolLM3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ("Exaone4ForCausalLM", {"sliding_window_pattern": "LLLG"}, "sliding_window_pattern"),
        ("Olmo3ForCausalLM", {"sliding_window": None}, "sliding_window"),
        ("Olmo2ForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("GptOssForCausalLM", {"swiglu_limit": None}, "swiglu_limit=null"),
        ("GptOssForCausalLM", {"swiglu_alpha": -1.0}, "swiglu_alpha"),
        ("GptOssForCausalLM", {"num_experts_per_tok": 129}, "num_experts_per_tok"),
    ],
)
def test_new_families_refuse_what_they_cannot_read_by_name(architecture, keys, message):
    with pytest.raises(ValueError, match=message):
        DecoderArgs.from_hf_config(_small(architecture, **keys))


@pytest.mark.parametrize("kind_rope, key", [
    ({"rope_type": "default", "rope_theta": -5.0}, "rope_theta"),
    ({"rope_type": "linear", "factor": 0}, "factor"),
    ({"rope_type": "yarn", "factor": float("nan")}, "factor"),
])
def test_a_layer_kinds_own_rope_numbers_are_checked(kind_rope, key):
    """A kind's own rope_parameters (Gemma 3's sliding layers here) are read past the top-level checks: a
    negative base or a zero or NaN factor would have made NaN tables; each is refused by name."""
    rope = {"sliding_attention": kind_rope, "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=f"RoPE {key}="):
        DecoderArgs.from_hf_config(_small("Gemma3ForCausalLM", head_dim=16, rope_parameters=rope))


@pytest.mark.parametrize("band", [{}, {"low_freq_factor": 1.0}, {"low_freq_factor": 4.0, "high_freq_factor": 4.0},
                                  {"low_freq_factor": -1.0, "high_freq_factor": 4.0}])
def test_a_llama3_rope_without_its_band_is_refused_by_name(band):
    """Found by the untrusted-input fuzzer (gpt-oss's folder given rope_type llama3): a KeyError, or equal factors'
    division by zero, before."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 32, **band}
    with pytest.raises(ValueError, match="low_freq_factor"):
        DecoderArgs.from_hf_config(_small("LlamaForCausalLM", rope_parameters=rope))


def test_rope_scaling_beside_a_different_rope_parameters_is_refused():
    """transformers lets the older rope_scaling override rope_parameters (the untrusted-input fuzzer's OLMo 3
    folder): coreserve read rope_parameters alone; ambiguous, so refused by name."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_scaling and rope_parameters"):
        DecoderArgs.from_hf_config(_small("LlamaForCausalLM", rope_parameters=rope,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert DecoderArgs.from_hf_config(_small("LlamaForCausalLM", rope_parameters=rope, rope_scaling=rope)).rope.theta == 1e4


@pytest.mark.parametrize("original", ["", 32.5, 0, True])
def test_a_rope_original_context_that_is_not_a_positive_integer_is_refused_by_name(original):
    """'' was a TypeError in YaRN's correction range (the untrusted-input fuzzer, gpt-oss's folder)."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": original}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        DecoderArgs.from_hf_config(_small("LlamaForCausalLM", rope_parameters=rope))
