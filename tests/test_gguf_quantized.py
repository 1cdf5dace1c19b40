"""GGUF weights kept in their blocks (dtype "auto", coreserve/worker/models/gguf_quantized.py and quantized.py): a
whole model run quantized in memory gives the bits of the same file dequantized to fp32 at load, sample
and prompt logprobs (==) and greedy tokens, batched and each prompt alone, fused decode included: the
real SmolLM2 Q4_1 file (Q8_0 tied embeddings) and small random Q8_0 / Q4_0 files. The quantized model
holds the file's bytes, not an fp32 copy; tensor parallelism keeps each rank's blocks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf_files import write_gguf_model

from coreserve import LLM, SamplingParams
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.worker.models.loader import load_model
from coreserve.worker.models.quantized import (
    QUANT_PARTS,
    QuantEmbedding,
    QuantLinear,
    block_values,
    dequantize,
)
from coreserve.worker.models.sharding import Shard

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=5)
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of",
                   "Here is a list of fruits: apple, banana,", "To make a cup of tea, first"]
RANDOM_PROMPTS = [{"prompt_token_ids": ids} for ids in ([1, 2, 3], [500, 20, 7, 99, 301, 12], [42] * 9)]


def numbers(outputs: list) -> list:
    """Per request: the greedy tokens, each listed (id, logprob, rank), and the prompt logprobs."""
    return [
        (o.outputs[0].token_ids, [[(t, v.logprob, v.rank) for t, v in d.items()] for d in o.outputs[0].logprobs],
         [None if d is None else [(t, v.logprob, v.rank) for t, v in d.items()] for d in o.prompt_logprobs])
        for o in outputs
    ]


def runs(model: str, prompts: list, dtype: str) -> tuple[list, list, object]:
    """(all prompts batched, each prompt alone) and the runner's model, in one in-process engine."""
    with LLM(model, multiprocess=False, dtype=dtype, num_kv_blocks=256) as llm:
        batched = numbers(llm.generate(prompts, PARAMS, use_tqdm=False))
        alone = [numbers(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]
        runner = llm.client.core.executor
        return batched, alone, (runner.model, runner.backend.fused)


def assert_quantized_run_is_the_fp32_run(
    model: str, prompts: list, ggml_type: int, is_fused: bool = True
) -> None:
    batched, alone, (quantized_model, fused) = runs(model, prompts, "auto")
    assert isinstance(quantized_model.layers[0].qkv_proj, QuantLinear)
    assert quantized_model.layers[0].down_proj.ggml_type == ggml_type
    assert fused is not None and fused.applies == is_fused  # decode steps took the fused forward, or not
    fp32_batched, fp32_alone, (fp32_model, _) = runs(model, prompts, "float32")
    assert fp32_model.layers[0].qkv_proj.weight.dtype == torch.float32
    assert batched == fp32_batched
    assert alone == fp32_alone
    assert alone == batched  # batch invariance holds for the quantized products too


@pytest.fixture(scope="module")
def random_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("quantized")
    paths = {}
    for type_name in ("Q8_0", "Q4_0"):
        paths[type_name] = str(folder / f"{type_name}.gguf")
        write_gguf_model(Path(paths[type_name]), {}, default_type=type_name, vocab_size=2048)
    return paths


@pytest.mark.parametrize("type_name, ggml_type", [("Q8_0", 8), ("Q4_0", 2)])
def test_a_random_gguf_run_quantized_gives_the_bits_of_its_fp32_dequantization(random_files, type_name, ggml_type):
    assert_quantized_run_is_the_fp32_run(random_files[type_name], RANDOM_PROMPTS, ggml_type)


LAYER_NAMES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.mark.parametrize("type_name, ggml_type", [("Q4_0", 2), ("Q8_0", 8)])
def test_layers_with_a_q6_k_output_take_the_fused_forward_with_the_fp32_bits(tmp_path, type_name, ggml_type):
    """llama-quantize's Q4_0 preset (and others): the output matrix in Q6_K. The layers are one kind, so
    decode runs the fused forward, its lm_head the Q6_K super-blocks."""
    path = tmp_path / f"{type_name}_q6_k.gguf"
    write_gguf_model(path, {"lm_head.weight": "Q6_K"}, type_name, vocab_size=2048)
    model = load_model(str(path), "auto", torch.device("cpu"))
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.ggml_type == 14
    assert_quantized_run_is_the_fp32_run(str(path), RANDOM_PROMPTS, ggml_type)


def test_k_quant_layers_and_embedding_take_the_fused_forward_with_the_fp32_bits(tmp_path):
    path = tmp_path / "q5_k.gguf"
    write_gguf_model(path, {"lm_head.weight": "Q6_K", "model.embed_tokens.weight": "Q4_K"}, "Q5_K", vocab_size=2048)
    model = load_model(str(path), "auto", torch.device("cpu"))
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.ggml_type == 12
    assert_quantized_run_is_the_fp32_run(str(path), RANDOM_PROMPTS, 13)


def test_a_q4_k_m_layout_keeps_its_k_quants_and_gives_the_fp32_bits(tmp_path):
    """Q4_K_M's mix: Q4_K, with Q6_K for some layers' attn_v and ffn_down and for the output. A layer
    whose q/k/v are of two types keeps each run of rows in its own (QUANT_PARTS), whole and on each
    tensor-parallel rank. decode_forward.c reads each product's own type: decode runs fused."""
    path = tmp_path / "q4_k_m.gguf"
    mixed = {"model.layers.1.self_attn.v_proj.weight": "Q6_K", "model.layers.1.mlp.down_proj.weight": "Q6_K",
             "model.layers.0.mlp.gate_proj.weight": "Q5_K"}
    write_gguf_model(path, {**mixed, "lm_head.weight": "Q6_K"}, "Q4_K", vocab_size=2048)
    model = load_model(str(path), "auto", torch.device("cpu"))
    assert model.layers[1].down_proj.ggml_type == 14 and model.layers[1].o_proj.ggml_type == 12
    for shard in (None, Shard(0, 2), Shard(1, 2)):  # each rank's q, k, v and gate, up rows: runs too
        model = load_model(str(path), "auto", torch.device("cpu"), shard)
        fp32 = load_model(str(path), "float32", torch.device("cpu"), shard)
        qkv, gate_up = model.layers[1].qkv_proj, model.layers[0].gate_up_proj
        a = model.args
        q_k_rows, v_rows = (a.num_heads + a.num_kv_heads) * a.head_dim, a.num_kv_heads * a.head_dim
        assert qkv.ggml_type == QUANT_PARTS and qkv.weight.ggml_parts == ((q_k_rows, 12), (v_rows, 14))
        assert gate_up.weight.ggml_parts == ((a.intermediate_size, 13), (a.intermediate_size, 12))
        for name in ("layers.1.qkv_proj", "layers.0.gate_up_proj", "layers.0.qkv_proj"):
            weight = model.get_submodule(name).weight
            assert torch.equal(block_values(weight), fp32.get_submodule(name).weight), (name, shard)
    assert_quantized_run_is_the_fp32_run(str(path), RANDOM_PROMPTS, 12)


def test_layers_of_different_types_take_the_fused_forward_with_the_fp32_bits(tmp_path):
    """Q4_0 layers and a Q8_0 one: decode_forward.c reads each product's own ggml type."""
    path = tmp_path / "mixed.gguf"
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    write_gguf_model(path, {f"model.layers.1.{n}.weight": "Q8_0" for n in names}, "Q4_0", vocab_size=2048)
    model = load_model(str(path), "auto", torch.device("cpu"))
    assert (model.layers[0].qkv_proj.ggml_type, model.layers[1].qkv_proj.ggml_type) == (2, 8)
    assert_quantized_run_is_the_fp32_run(str(path), RANDOM_PROMPTS, 2)


def test_smollm2_q4_1_run_quantized_gives_the_bits_of_its_fp32_dequantization():
    assert_quantized_run_is_the_fp32_run(builtin_model_path("smollm2"), SMOLLM2_PROMPTS, 3)


def test_the_quantized_model_holds_the_files_bytes_not_an_fp32_copy():
    path = builtin_model_path("smollm2")
    model = load_model(path, "auto", torch.device("cpu"))
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.ggml_type == 8
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one copy of the blocks
    held = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    assert 0.95 * os.path.getsize(path) < held < os.path.getsize(path)  # the rest: metadata, the tokenizer
    fp32 = load_model(path, "float32", torch.device("cpu"))
    assert held < 0.2 * sum(p.numel() * p.element_size() for p in fp32.parameters())
    ids = torch.tensor([0, 17, 49151, 17])
    assert torch.equal(model.embed_tokens(ids), fp32.embed_tokens(ids))
    for name in ("layers.0.qkv_proj", "layers.29.gate_up_proj", "layers.5.o_proj"):  # q/k rows reordered too
        layer = model.get_submodule(name)
        assert torch.equal(dequantize(layer.weight, layer.ggml_type), fp32.get_submodule(name).weight), name


def test_tensor_parallel_ranks_keep_their_blocks_which_are_the_fp32_ranks_values(random_files):
    path = random_files["Q4_0"]  # 4 heads, 2 KV heads: SmolLM2's 9 heads do not split over 2 ranks
    for rank in (0, 1):
        shard = Shard(rank, 2)
        model = load_model(path, "auto", torch.device("cpu"), shard)
        fp32 = load_model(path, "float32", torch.device("cpu"), shard)
        for name in ("layers.0.qkv_proj", "layers.0.o_proj", "layers.1.gate_up_proj", "layers.1.down_proj"):
            layer = model.get_submodule(name)  # o and down split by input features: 4 and 8 blocks a row
            assert isinstance(layer, QuantLinear), name
            assert torch.equal(dequantize(layer.weight, layer.ggml_type), fp32.get_submodule(name).weight), name


def test_explicit_dtypes_dequantize_at_load():
    path = builtin_model_path("smollm2")
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = load_model(path, dtype, torch.device("cpu"))
        assert not any(isinstance(m, QuantLinear | QuantEmbedding) for m in model.modules())
        assert model.layers[0].qkv_proj.weight.dtype == torch_dtype
