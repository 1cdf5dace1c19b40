"""gpt-oss GGUF files (`gpt-oss`) as llama.cpp's own converter writes them from float experts (its
convert_hf_to_gguf.py, run in a subprocess from the folder scripts/setup.sh extracts, kept by their input's digest):
experts stacked [experts, rows, columns] with their biases, gate and up de-interleaved into two tensors, the sinks
as `attn_sinks.weight`. The folder is the gpt_oss family model as llama.cpp runs such a file: a tokenizer its
converter knows (llama3's), the clamp at llama.cpp's fixed limit 7 (its experts' gate_up scaled so that some values
cross it) and YaRN's range floored and ceiled (HF's truncate, where the hub's gpt-oss says false). The f32 file
gives HF transformers' logprobs on that folder; the Q8_0 file kept in its blocks (experts too) gives the bits of
the same file dequantized, alone and batched; a sliding layers' RoPE base of their own is a ValueError naming it.
The same folder with MXFP4 experts (the hub's `_blocks` and `_scales`, which the converter keeps in MXFP4, type
39): kept in their blocks, the bits of the file dequantized, alone and batched, and HF's logprobs on the folder
(transformers dequantizes MXFP4 on a CPU); in integer mode a request alone is its bits batched.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from conftest import FAMILY_CONFIGS, load_hf, write_family_model, write_mxfp4_experts
from test_gguf_families import numbers
from test_gguf_hybrid import (
    PARAMS,
    PROMPTS,
    assert_blocks_give_fp32s_bits,
    assert_gives_hfs_logprobs,
    convert,
    needs_converter,
    run,
)

from coreserve import LLM
from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder
from coreserve.protocol.gguf_header import read_gguf_header
from coreserve.worker.models.gguf_config import hf_config_from_gguf
from coreserve.worker.models.loader import read_config
from coreserve.worker.models.quantized import MXFP4, QuantLinear

GATE_UP_SCALE = 3.0  # the random experts' largest gate/up value is 4.3: scaled past the limit of 7


def _llama_cpp_folder(folder: Path) -> Path:
    """The gpt_oss family model with what llama.cpp fixes in its code: limit 7, YaRN truncated; llama3's tokenizer."""
    import torch
    from safetensors.torch import load_file, save_file

    spec = dict(FAMILY_CONFIGS["gpt_oss"], tokenizer="llama3", swiglu_limit=7.0)
    spec["rope_parameters"] = dict(spec["rope_parameters"], truncate=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILY_CONFIGS, "gpt_oss_llama_cpp", spec)
        write_family_model(folder, "gpt_oss_llama_cpp")
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    with torch.no_grad():
        tensors = {n: t * GATE_UP_SCALE if n.endswith("experts.gate_up_proj") else t for n, t in tensors.items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(the folder, {"f32": its file, "q8_0": its file}), both written by the converter at once."""
    out = tmp_path_factory.mktemp("gpt-oss-gguf")
    folder = _llama_cpp_folder(out / "folder")
    return folder, convert({"f32": (folder, []), "q8_0": (folder, [])}, out)


@needs_converter
def test_converted_gguf_gives_hfs_logprobs_and_its_blocks_their_dequantizations_bits(gpt_oss):
    folder, files = gpt_oss
    config = read_config(files["f32"])
    assert config["architectures"] == ["GptOssForCausalLM"] and config["sliding_window"] == 8
    assert config["layer_types"] == ["sliding_attention", "full_attention"]  # llama.cpp's pattern 2
    assert (config["swiglu_alpha"], config["swiglu_limit"]) == (1.702, 7.0)
    assert "truncate" not in config["rope_parameters"]  # HF's default, true: llama.cpp's floor and ceil
    outputs, _ = run(files["f32"], "float32", alone=False)
    assert_gives_hfs_logprobs(outputs, load_hf(str(folder)))
    modules = {"layers.0.qkv_proj", "layers.1.o_proj", "layers.0.moe.experts.3.gate_up_proj",
               "layers.1.moe.experts.0.down_proj"}
    assert_blocks_give_fp32s_bits(files["q8_0"], modules)


def test_a_gpt_oss_files_tokenizer_converts_with_none_cached(tmp_path):
    """transformers' GGUF reader fails on a gpt-oss file's YaRN keys (5.25: float() of a key's array), so its
    tokenizer is built from the `tokenizer.*` keys alone, not only found cached from another file of the same
    keys (every llama3 test file's, say)."""
    import gguf
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt-oss")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    byte_tokens = bytes_to_unicode()  # byte b is token b, then one merge: a byte-level BPE of 258 tokens
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([byte_tokens[b] for b in range(256)] + ["Th", "<|return|>"])
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["T h"])
    writer.add_eos_token_id(257)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = gguf_tokenizer_folder(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("The cat", add_special_tokens=False).input_ids == [256, *b"e cat"]


@needs_converter
def test_a_sliding_layers_rope_base_of_their_own_is_refused_by_name(gpt_oss):
    header = read_gguf_header(gpt_oss[1]["f32"])
    metadata = {**header.metadata, "gpt-oss.rope.freq_base_swa": 10000.0}
    with pytest.raises(ValueError, match="gpt-oss.rope.freq_base_swa=10000.0"):
        hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))


@needs_converter
@pytest.mark.parametrize(("key", "value"), [("attention.value_length", 8), ("rope.dimension_count", 8)])
def test_v_heads_of_another_size_or_rope_on_part_of_each_head_are_refused_by_name(gpt_oss, key, value):
    """Keys llama.cpp would read and coreserve had ignored (found by the untrusted-input fuzzer)."""
    header = read_gguf_header(gpt_oss[1]["f32"])
    metadata = {**header.metadata, f"gpt-oss.{key}": value}
    with pytest.raises(ValueError, match=f"gpt-oss.{key}=8"):
        hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory) -> tuple[Path, str]:
    """(the folder with MXFP4 experts, its file as the converter writes it: --outtype f32, experts kept MXFP4)."""
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4-gguf")
    folder = out / "folder"
    shutil.copytree(gpt_oss[0], folder)
    write_mxfp4_experts(folder)
    return folder, convert({"f32": (folder, [])}, out)["f32"]


@needs_converter
def test_mxfp4_experts_kept_in_blocks_give_their_dequantizations_bits_and_hfs_logprobs(gpt_oss_mxfp4):
    folder, path = gpt_oss_mxfp4
    types = {t.name: t.ggml_type for t in read_gguf_header(path).tensors}
    assert {types[f"blk.{i}.ffn_{m}_exps.weight"] for i in (0, 1) for m in ("gate", "up", "down")} == {MXFP4}
    kept: list[str] = []
    batched, alone = run(path, "auto", kept)
    assert {"layers.0.moe.experts.3.gate_up_proj", "layers.1.moe.experts.0.down_proj"} <= set(kept)
    assert "layers.0.qkv_proj" not in kept  # f32 in the file
    fp32_batched, fp32_alone = run(path, "float32")
    assert numbers(batched) == numbers(fp32_batched) and numbers(alone) == numbers(fp32_alone)
    assert_gives_hfs_logprobs(fp32_batched, load_hf(str(folder)))


@needs_converter
def test_mxfp4_experts_in_integer_mode_give_a_request_alone_its_bits_batched(gpt_oss_mxfp4):
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    params = [PARAMS[i % 2] for i in range(len(PROMPTS))]
    with LLM(gpt_oss_mxfp4[1], multiprocess=False, quantized_activations="int8", max_num_batched_tokens=16) as llm:
        model = llm.client.core.executor.model
        assert llm.client.core.executor.backend.is_int8 and model.ops.is_int8
        assert isinstance(model.layers[0].moe.experts[1].down_proj, QuantLinear)
        batched = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert numbers(batched) == numbers(alone)
    exact, _ = run(gpt_oss_mxfp4[1], "auto", alone=False)
    assert numbers(batched) != numbers(exact)  # the mode is on: its numbers are its own
