"""Random cases for the GGUF differential fuzzer (tests/test_gguf_fuzz.py, scripts/fuzz_models.py): a small
model of one family with a config drawn from a seed (widths that are not multiples of 256 beside some
that are, odd head counts and GQA ratios, tied or untied outputs, windows, soft-caps, q/k clamps and RoPE
scalings where the family has them), the ggml type of each of its GGUF tensors (one loader type, or a
llama-quantize-like mix), the prompts and the requests. What a case asks of the engine is in
gguf_fuzz_check.py; how its files are written, gguf_fuzz_files.py. FAMILIES' files are written by our own
writer; CONVERTED_FAMILIES' (HYBRID_FAMILIES, gguf_fuzz_hybrid.py: Qwen3.5, Qwen3-Next, LFM2, Granite 4.0-H;
ATTENTION_FAMILIES, gguf_fuzz_attention.py: OLMo 2, OLMo 3, SmolLM3, Exaone 4, gpt-oss) by llama.cpp's converter,
then re-typed (gguf_fuzz_convert.py).

A case is a pure function of (seed, family, weight type): the same three give the same files and requests.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from gguf_fuzz_attention import ATTENTION_FAMILIES, draw_attention_config
from gguf_fuzz_hybrid import HYBRID_FAMILIES, draw_hybrid_config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi4-mini", "gemma2", "gemma3", "qwen3_moe",
            "mixtral", "olmoe")
CONVERTED_FAMILIES = HYBRID_FAMILIES + ATTENTION_FAMILIES  # their files: llama.cpp's converter's, re-typed
ALL_FAMILIES = FAMILIES + CONVERTED_FAMILIES
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# types outside make test's sample (tests/test_gguf_fuzz.py's Latin square): gpt-oss's experts' MXFP4, here asked
# of every re-typed tensor as any other type (llama.cpp reads an MXFP4 matrix wherever it is)
MORE_TYPES = ("MXFP4",)
K_MIXES = ("Q3_K_M", "Q4_K_M", "Q5_K_M")  # llama-quantize's recipes, as k_mix_type has them
MIXES = (*K_MIXES, "mixed")  # "mixed": a random type a tensor
# The real llama-quantize (when scripts/build_llama_server.sh has built it) on the case's F32 file: its
# recipes of the types coreserve reads (the IQ ones are not)
LLAMA_QUANTIZE = tuple(f"llama-quantize:{ftype}" for ftype in (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S",
    "Q5_K_M", "Q6_K", "MXFP4_MOE"))  # MXFP4_MOE: experts MXFP4, the other matrices Q8_0
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# llama-quantize's type for a tensor whose rows are not whole blocks of the asked one (tensor_type_fallback in
# llama.cpp's src/llama-quant.cpp, the version scripts/build_llama_server.sh builds); F16 where that fails too
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_HIDDEN = (96, 160, 224, 256, 320, 512)
# the hybrid families' keys a failure's report shows
_HYBRID_KEYS = ("num_hidden_layers", "layer_types", "swiglu_limit", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "shared_expert_intermediate_size", "conv_L_cache", "conv_bias", "block_auto_adjust_ff_dim",
                "block_multiple_of", "block_ffn_dim_multiplier", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                "mamba_d_state", "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias", "shared_intermediate_size")
_SHARED_HEAD_DIM = ("llama", "mistral", "qwen2", "phi3", "phi4-mini", "mixtral", "olmoe")  # hidden / heads
_MODEL_TYPES = {"phi4-mini": "phi3", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class FuzzCase:
    seed: int
    family: str
    weight_type: str  # one of TYPES, MORE_TYPES, MIXES or LLAMA_QUANTIZE: what the GGUF's 2-D tensors are asked to be in
    embed_type: str  # token_embd's (the output's too where tied)
    output_type: str  # an untied output's
    config: dict  # the Hugging Face config.json (model_type included) the GGUF's metadata stands for
    prompts: tuple[tuple[int, ...], ...]
    requests: tuple[dict, ...]  # SamplingParams keywords, one per prompt
    engine: dict  # LLM keywords besides the model and dtype

    @property
    def name(self) -> str:
        return f"{self.family}-{self.weight_type}-seed{self.seed}"

    def describe(self) -> str:
        """One line: the drawn shape, for a failure's report."""
        c = self.config
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "sliding_window", "attn_logit_softcapping",
                "final_logit_softcapping", "clip_qkv", "num_experts", "num_local_experts", "num_experts_per_tok",
                "moe_intermediate_size", "mlp_only_layers", "attention_bias", *_HYBRID_KEYS)
        shape = " ".join(f"{k}={c[k]}" for k in keys if c.get(k) not in (None, False, []))
        rope = c.get("rope_parameters") or {}
        rope_type = rope.get("rope_type") or rope.get("full_attention", {}).get("rope_type", "default")
        rope_type += f"/{rope['partial_rotary_factor']}" if "partial_rotary_factor" in rope else ""
        return f"{shape} rope={rope_type} embed={self.embed_type} output={self.output_type} engine={self.engine}"

    def requested_type(self, gguf_name: str, num_layers: int) -> str:
        """The type `gguf_name` (a 2-D or experts tensor) is asked to be in, before any fallback."""
        parts = gguf_name.split(".")
        role, layer = parts[-2], int(parts[1]) if parts[0] == "blk" else -1
        if role == "token_embd":
            return self.embed_type
        if role == "output":
            return self.output_type
        if self.weight_type == "mixed":
            return TYPES[zlib.crc32(f"{self.seed}:{gguf_name}".encode()) % len(TYPES)]
        if self.weight_type in K_MIXES:
            return k_mix_type(self.weight_type, role, layer, num_layers, self._num_experts())
        return "F32" if self.weight_type in LLAMA_QUANTIZE else self.weight_type

    def _num_experts(self) -> int:
        return self.config.get("num_experts") or self.config.get("num_local_experts") or 0


def fitted_type(kind: str, num_in: int) -> str:
    """`kind`, or llama-quantize's fallback where rows of `num_in` values are not whole blocks of it."""
    if kind in K_TYPES and num_in % 256:
        kind = FALLBACK[kind]
    if kind not in ("F32", "F16", "BF16") and num_in % 32:
        return "F16"
    return kind


def k_mix_type(mix: str, role: str, layer: int, num_layers: int, num_experts: int) -> str:
    """llama-quantize's choice for its Q3_K_M / Q4_K_M / Q5_K_M recipes (llama_tensor_get_type in
    src/llama-quant.cpp, not Falcon): attn_v and a fused attn_qkv get more bits on some layers, as does
    ffn_down; attn_output one step up in Q3_K_M; an 8-expert model's attn_k and attn_v in Q8_0."""
    base = mix[:4]
    role = role.removesuffix("_exps")
    if role in ("attn_v", "attn_qkv"):  # "attn_v-like"; one a layer, so its count is the layer's index
        if num_experts == 8:
            return "Q8_0"
        if mix == "Q3_K_M":
            return "Q5_K" if layer < 2 else "Q4_K"
        return "Q6_K" if _use_more_bits(layer, num_layers) else base
    if role == "attn_k" and num_experts == 8:
        return "Q8_0"
    if role == "ffn_down":
        if mix == "Q3_K_M":
            return "Q5_K" if layer < num_layers // 16 else "Q4_K"
        return "Q6_K" if _use_more_bits(layer, num_layers) else base
    if role == "attn_output" and num_experts == 8:
        return "Q5_K" if mix != "Q5_K_M" else base
    return "Q4_K" if role == "attn_output" and mix == "Q3_K_M" else base


def _use_more_bits(layer: int, num_layers: int) -> bool:
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def draw_case(seed: int, family: str, weight_type: str) -> FuzzCase:
    """The case of (seed, family, weight type)."""
    rng = np.random.default_rng([seed, zlib.crc32(family.encode()), zlib.crc32(weight_type.encode())])
    config = draw_config(rng, family, needs_k_rows=weight_type not in TYPES + MORE_TYPES or weight_type in K_TYPES)
    vocab = config["vocab_size"]
    lengths = [1, *rng.integers(2, 40, 2)]
    rng.shuffle(lengths)
    prompts = tuple(tuple(int(t) for t in rng.integers(0, vocab - 1, n)) for n in lengths)
    requests = tuple(_draw_request(rng, i) for i in range(len(prompts)))
    # the torch path (can_use_cpu_kernels=False, CUDA's ops) a fifth of the time: blocks dequantized per call
    engine = dict(max_num_batched_tokens=int(rng.choice([8, 16, 64, 512])), block_size=int(rng.choice([8, 16])),
                  num_kv_blocks=96, max_num_seqs=8, num_scheduler_steps=int(rng.choice([1, 1, 4])),
                  can_use_cpu_kernels=bool(rng.random() < 0.8))
    embed_type, output_type = _draw_top_types(rng, weight_type, config["tie_word_embeddings"])
    return FuzzCase(seed, family, weight_type, embed_type, output_type, config, prompts, requests, engine)


def _draw_top_types(rng: np.random.Generator, weight_type: str, is_tied: bool) -> tuple[str, str]:
    """token_embd's and the output's types: llama-quantize's for its recipes (the output, or a tied
    embedding, in Q6_K); else the case's type half the time, another the other half."""
    if weight_type in K_MIXES:
        return "Q6_K" if is_tied else weight_type[:4], "Q6_K"
    if weight_type in LLAMA_QUANTIZE:
        return "F32", "F32"
    if weight_type not in TYPES + MORE_TYPES:
        return str(rng.choice(TYPES)), str(rng.choice(TYPES))
    others = K_TYPES if weight_type in K_TYPES else TYPES
    embed_type = weight_type if rng.random() < 0.5 else str(rng.choice(others))
    return embed_type, weight_type if rng.random() < 0.5 else str(rng.choice(("Q6_K", "Q8_0", *TYPES)))


def _draw_request(rng: np.random.Generator, index: int) -> dict:
    request = dict(max_tokens=int(rng.integers(1, 10)), ignore_eos=True, logprobs=int(rng.choice([0, 1, 5, 20])),
                   prompt_logprobs=[None, 0, 1, 5, 20][rng.integers(5)])
    if index % 2:  # a seeded sampled request: the same noise in every run, so its tokens are comparable
        request.update(temperature=float(rng.choice([0.5, 1.0])), seed=int(rng.integers(1 << 30)))
    else:
        request.update(temperature=0.0)
    return request


def draw_config(rng: np.random.Generator, family: str, needs_k_rows: bool = False) -> dict:
    """A Hugging Face config of `family`, 2 layers; `needs_k_rows`: the MLP's width a multiple of 256, so
    that K-quant types fit the down projections whatever the hidden width."""
    if family in HYBRID_FAMILIES:
        return draw_hybrid_config(rng, family, needs_k_rows)
    if family in ATTENTION_FAMILIES:
        return draw_attention_config(rng, family, needs_k_rows)
    hidden = int(rng.choice(_HIDDEN))
    if family in _SHARED_HEAD_DIM:
        head_dim = int(rng.choice([d for d in (16, 32, 64) if hidden % d == 0 and hidden // d <= 16]))
        num_heads = hidden // head_dim
    else:  # a head size of its own; HF's configs still want whole heads in the hidden width
        head_dim, num_heads = int(rng.choice([16, 32, 64])), int(rng.choice([h for h in range(1, 8) if hidden % h == 0]))
    kv_heads = int(rng.choice([k for k in range(1, num_heads + 1) if num_heads % k == 0]))
    widths = (256, 512, 768) if needs_k_rows else (64, 96, 128, 192, 256, 352, 512)
    vocab = int(rng.choice([260, 300, 384, 512]))
    config = dict(
        model_type=_MODEL_TYPES.get(family, family), hidden_size=hidden, intermediate_size=int(rng.choice(widths)),
        num_hidden_layers=2, num_attention_heads=num_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        vocab_size=vocab, bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
        max_position_embeddings=256, rms_norm_eps=float(np.float32(rng.choice([1e-5, 1e-6]))),
        tie_word_embeddings=bool(rng.random() < 0.5), hidden_act="silu",
        rope_parameters=dict(rope_type="default", rope_theta=float(rng.choice([10000.0, 1000000.0]))),
    )
    config.update(_FAMILY_DRAWS[family](rng, config, needs_k_rows))
    return config


def _window(rng: np.random.Generator) -> int | None:
    return None if rng.random() < 0.3 else int(rng.choice([8, 16, 24]))


def _rope(rng: np.random.Generator, config: dict, kinds: tuple[str, ...]) -> dict:
    """Default, linear or YaRN RoPE (YaRN's factor is the context's over its original, as HF wants)."""
    kind, theta = str(rng.choice(kinds)), config["rope_parameters"]["rope_theta"]
    if kind == "linear":
        return dict(rope_type="linear", rope_theta=theta, factor=float(rng.choice([2.0, 4.0])))
    if kind == "yarn":
        original = int(rng.choice([32, 64]))
        return dict(rope_type="yarn", rope_theta=theta, factor=256 / original, original_max_position_embeddings=original)
    return config["rope_parameters"]


def _llama(rng, config, needs_k_rows) -> dict:
    return dict(attention_bias=bool(rng.random() < 0.3), rope_parameters=_rope(rng, config, ("default", "linear", "yarn")))


def _mistral(rng, config, needs_k_rows) -> dict:
    return dict(sliding_window=_window(rng))


def _qwen2(rng, config, needs_k_rows) -> dict:
    return dict(rope_parameters=_rope(rng, config, ("default", "yarn")))


def _qwen3(rng, config, needs_k_rows) -> dict:
    return dict(attention_bias=bool(rng.random() < 0.3), rope_parameters=_rope(rng, config, ("default", "linear")))


def _phi3(rng, config, needs_k_rows, partial: float = 1.0) -> dict:
    """Phi-3 (a window, LongRoPE or not) and Phi-4-mini (partial rotary under LongRoPE). LongRoPE's
    factors: one per rotary frequency; its switch to the long ones at a context of 32 or 64."""
    keys = dict(sliding_window=_window(rng), pad_token_id=0)
    if partial == 1.0 and rng.random() < 0.5:
        return keys
    rotary = int(config["head_dim"] * partial)
    original = int(rng.choice([32, 64]))
    keys.update(original_max_position_embeddings=original, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial,
        short_factor=[float(np.float32(1.0 + 0.05 * i)) for i in range(rotary // 2)],
        long_factor=[float(np.float32(1.5 + 0.75 * i)) for i in range(rotary // 2)],
        original_max_position_embeddings=original))
    return keys


def _phi4_mini(rng, config, needs_k_rows) -> dict:
    return _phi3(rng, config, needs_k_rows, partial=float(rng.choice([0.5, 0.75])))


def _gemma2(rng, config, needs_k_rows) -> dict:
    """Local and global layers in turn; llama.cpp's query scale is the head size's (no GGUF key)."""
    return dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", pad_token_id=0,
                sliding_window=int(rng.choice([8, 16, 24])), query_pre_attn_scalar=config["head_dim"],
                attn_logit_softcapping=[None, 5.0, 50.0][rng.integers(3)],
                final_logit_softcapping=[None, 8.0, 30.0][rng.integers(3)])


def _gemma3(rng, config, needs_k_rows) -> dict:
    """A local layer (its own RoPE base) then a global one (linear scaling or none)."""
    glob = dict(rope_type="default", rope_theta=1000000.0)
    if rng.random() < 0.5:
        glob.update(rope_type="linear", factor=8.0)
    return dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", pad_token_id=0,
                sliding_window=int(rng.choice([8, 16, 24])), query_pre_attn_scalar=config["head_dim"],
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                 "full_attention": glob})


def _experts(rng: np.random.Generator) -> tuple[int, int]:
    """(experts, experts a token)."""
    return int(rng.choice([4, 8])), int(rng.integers(1, 4))


def _qwen3_moe(rng, config, needs_k_rows) -> dict:
    """llama.cpp renormalises Qwen3-MoE's top-k (no GGUF key); a layer without a router is dense."""
    num_experts, top_k = _experts(rng)
    widths = (256,) if needs_k_rows else (32, 64, 96, 256)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                moe_intermediate_size=int(rng.choice(widths)), mlp_only_layers=[[], [1]][rng.integers(2)],
                attention_bias=bool(rng.random() < 0.3))


def _mixtral(rng, config, needs_k_rows) -> dict:
    num_experts, top_k = _experts(rng)
    return dict(num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=_window(rng))


def _olmoe(rng, config, needs_k_rows) -> dict:
    """OLMoE's top-k probabilities as they are (llama.cpp's rule, no GGUF key)."""
    num_experts, top_k = _experts(rng)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=False, pad_token_id=0,
                clip_qkv=[None, 2.0, 8.0][rng.integers(3)])


_FAMILY_DRAWS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "phi3": _phi3,
                 "phi4-mini": _phi4_mini, "gemma2": _gemma2, "gemma3": _gemma3, "qwen3_moe": _qwen3_moe,
                 "mixtral": _mixtral, "olmoe": _olmoe}
