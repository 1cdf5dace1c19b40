"""gpt-oss GGUF files (`gpt-oss`) as llama.cpp's own converter writes them from float experts (its
convert_hf_to_gguf.py, run in a subprocess from the folder scripts/setup.sh extracts, kept by their input's digest):
experts stacked [experts, rows, columns] with their biases, gate and up de-interleaved into two tensors, the sinks
as `attn_sinks.weight`. The folder is the gpt_oss family model as llama.cpp runs such a file: a tokenizer its
converter knows (llama3's), the clamp at llama.cpp's fixed limit 7 (its experts' gate_up scaled so that some values
cross it) and YaRN's range floored and ceiled (HF's truncate, where the hub's gpt-oss says false). The f32 file
gives HF transformers' logprobs on that folder; the Q8_0 file kept in its blocks (experts too) gives the bits of
the same file dequantized, alone and batched; a sliding layers' RoPE base of their own is a ValueError naming it,
MXFP4 experts one naming their type.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import FAMILY_CONFIGS, load_hf, write_family_model
from test_gguf_hybrid import (
    assert_blocks_give_fp32s_bits,
    assert_gives_hfs_logprobs,
    convert,
    needs_converter,
    run,
)

from coreserve.protocol.gguf_header import read_gguf_header
from coreserve.worker.models.gguf_config import hf_config_from_gguf
from coreserve.worker.models.loader import read_config

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


@needs_converter
def test_a_sliding_layers_rope_base_of_their_own_is_refused_by_name(gpt_oss):
    header = read_gguf_header(gpt_oss[1]["f32"])
    metadata = {**header.metadata, "gpt-oss.rope.freq_base_swa": 10000.0}
    with pytest.raises(ValueError, match="gpt-oss.rope.freq_base_swa=10000.0"):
        hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))


@needs_converter
def test_mxfp4_experts_are_refused_by_their_type(gpt_oss, monkeypatch):
    """The hub's checkpoints' experts, which the converter keeps in MXFP4 (type 39): not built yet."""
    from coreserve.worker.models import gguf_weights

    header = read_gguf_header(gpt_oss[1]["f32"])
    mxfp4 = [dataclasses.replace(t, ggml_type=39) if "_exps.weight" in t.name else t for t in header.tensors]
    monkeypatch.setattr(gguf_weights, "read_gguf_header", lambda path: dataclasses.replace(header, tensors=mxfp4))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_\w+_exps\.weight has GGUF type MXFP4, which is not supported"):
        list(gguf_weights.list_tensors(header.path))
