"""LFM2 GGUF files (`lfm2`) as llama.cpp's own converter writes them (its convert_hf_to_gguf.py, run in a
subprocess from the folder scripts/setup.sh extracts) from the random lfm2 family model (a conv layer, then an
attention layer; its MLP auto-adjusted to 96 wide): the f32 file gives HF transformers' logprobs on the folder;
the Q8_0 file kept in its blocks gives the bits of the same file dequantized, alone and batched; a file whose
LFM2 keys are wrong is a ValueError naming the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import load_hf
from test_gguf_hybrid import (
    assert_blocks_give_fp32s_bits,
    assert_gives_hfs_logprobs,
    convert,
    needs_converter,
    run,
)

from coreserve.protocol.gguf_header import read_gguf_header
from coreserve.worker.models import gguf_weights
from coreserve.worker.models.gguf_config import hf_config_from_gguf
from coreserve.worker.models.loader import read_config


@pytest.fixture(scope="module")
def converted(family_model, tmp_path_factory) -> dict[str, str]:
    """{"f32": ..., "q8_0": ...}: the lfm2 folder's files, written by llama.cpp's converter at once."""
    source = Path(family_model("lfm2"))
    return convert({"f32": (source, []), "q8_0": (source, [])}, tmp_path_factory.mktemp("lfm2-gguf"))


@needs_converter
def test_f32_gguf_gives_hfs_logprobs(converted, family_model):
    """Prompt and sample logprobs of the f32 file within 1e-4 of HF's forward on the folder: the conv layer
    marked by its KV head count of 0, the MLP's width as the file holds it (not adjusted again), the conv
    kernel unsqueezed, the final norm from `token_embd_norm`."""
    path = converted["f32"]
    config = read_config(path)
    assert config["layer_types"] == ["conv", "full_attention"] and config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 96 and config["block_auto_adjust_ff_dim"] is False
    entries = {e.name: e for e in gguf_weights.list_tensors(path)}
    assert entries["model.layers.0.conv.conv.weight"].shape == (64, 1, 3)
    assert "model.embedding_norm.weight" in entries
    assert "model.layers.1.self_attn.q_layernorm.weight" in entries
    outputs, _ = run(path, "float32", alone=False)
    assert_gives_hfs_logprobs(outputs, load_hf(family_model("lfm2")))


@needs_converter
def test_q8_0_gguf_kept_in_blocks_gives_its_dequantizations_bits(converted):
    """dtype "auto" (the short conv's in_proj and out_proj, the attention and the MLP in their Q8_0 blocks)
    against dtype "float32" on the same file: the same numbers, batched and alone."""
    assert_blocks_give_fp32s_bits(converted["q8_0"], {"layers.0.conv.in_proj", "layers.0.conv.out_proj",
                                                      "layers.1.qkv_proj"})


@needs_converter
@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("attention.head_count_kv", np.array([0, 2, 2], dtype=np.int32), "holds 3 counts for 2 layers"),
        ("attention.head_count_kv", np.array([4, 2], dtype=np.int32), "different KV head counts"),
        ("attention.head_count_kv", np.array([0, -2], dtype=np.int32), "must be a KV head count"),
        ("shortconv.l_cache", None, "must be an integer in 2..64"),
        ("shortconv.l_cache", 1, "must be an integer in 2..64"),
        ("attention.layer_norm_rms_epsilon", None, "is missing"),
    ],
)
def test_bad_lfm2_keys_are_value_errors_naming_them(converted, key, value, words):
    header = read_gguf_header(converted["f32"])
    metadata = {k: v for k, v in header.metadata.items() if k != f"lfm2.{key}"}
    if value is not None:
        metadata[f"lfm2.{key}"] = value
    with pytest.raises(ValueError, match=f"lfm2.{key}.*{words}|{words}.*lfm2"):
        hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))
