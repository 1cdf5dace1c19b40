"""Granite 4.0-H GGUF files (`granitehybrid`) as llama.cpp's own converter writes them (its convert_hf_to_gguf.py,
run in a subprocess from the folder scripts/setup.sh extracts) from the random granitemoehybrid family model (a
Mamba2 layer, then NoPE attention; the converter knows the hub's `mamba` / `attention` layer names, so the
folder's config says those): the f32 file gives HF transformers' logprobs on the folder; the Q8_0 file kept in
its blocks gives the bits of the same file dequantized, alone and batched; a file whose Granite keys are wrong
is a ValueError naming the key; a `granitehybrid` file's tokenizer is converted where none is cached yet.
"""

from __future__ import annotations

import dataclasses
import json
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

from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder
from coreserve.protocol.gguf_header import read_gguf_header
from coreserve.worker.models import gguf_weights
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.gguf_config import hf_config_from_gguf
from coreserve.worker.models.loader import read_config


@pytest.fixture(scope="module")
def converted(family_model, tmp_path_factory) -> dict[str, str]:
    """{"f32": ..., "q8_0": ...}: the granitemoehybrid folder (its layer names the hub's) written by llama.cpp's
    converter at once."""
    source, out = Path(family_model("granitemoehybrid")), tmp_path_factory.mktemp("granite-gguf")
    folder = out / "hub-names"
    folder.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text()) | {"layer_types": ["mamba", "attention"]}
    (folder / "config.json").write_text(json.dumps(config))
    return convert({"f32": (folder, []), "q8_0": (folder, [])}, out)


@needs_converter
def test_f32_gguf_gives_hfs_logprobs(converted, family_model):
    """Prompt and sample logprobs of the f32 file within 1e-4 of HF's forward on the folder: the Mamba2 layer
    marked by its KV head count of 0, A_log from ssm_a = -exp(A_log), A, D and the gated norm's weight read
    back as vectors, the shared MLP's width (not feed_forward_length), the multipliers from their GGUF keys,
    NoPE (`rope.scaling.finetuned` false), q and k put back from llama.cpp's interleaved rows."""
    path = converted["f32"]
    config = read_config(path)
    assert config["layer_types"] == ["linear_attention", "full_attention"] and config["num_key_value_heads"] == 2
    assert config["shared_intermediate_size"] == 96 and config["position_embedding_type"] == "nope"
    args = DecoderArgs.from_hf_config(config)
    assert args.intermediate_size == 96 and (args.mamba.num_heads, args.mamba.num_groups) == (4, 2)
    assert args.layers[0].residual_multiplier == np.float32(0.6) and args.logits_scaling == np.float32(1.6)
    entries = {e.name: e for e in gguf_weights.list_tensors(path)}
    assert entries["model.layers.0.mamba.conv1d.weight"].shape == (128, 1, 4)
    assert entries["model.layers.0.mamba.norm.weight"].shape == (64,) and entries["model.layers.0.mamba.D"].shape == (4,)
    outputs, _ = run(path, "float32", alone=False)
    assert_gives_hfs_logprobs(outputs, load_hf(family_model("granitemoehybrid")))


@needs_converter
def test_q8_0_gguf_kept_in_blocks_gives_its_dequantizations_bits(converted):
    """dtype "auto" (the Mamba2's in_proj and out_proj, the attention and the MLP in their Q8_0 blocks) against
    dtype "float32" on the same file: the same numbers, batched and alone."""
    assert_blocks_give_fp32s_bits(converted["q8_0"], {"layers.0.mamba.in_proj", "layers.0.mamba.out_proj",
                                                      "layers.1.qkv_proj", "layers.0.gate_up_proj"})


@needs_converter
@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("attention.head_count_kv", np.array([0, 2, 2], dtype=np.int32), "holds 3 counts for 2 layers"),
        ("ssm.inner_size", 48, "must be a multiple of"),
        ("ssm.state_size", None, "must be a positive integer"),
        ("ssm.group_count", 3, "mamba_n_groups"),
        ("expert_count", 4, "GraniteMoeHybrid with experts"),
    ],
)
def test_bad_granite_keys_are_value_errors_naming_them(converted, key, value, words):
    header = read_gguf_header(converted["f32"])
    metadata = {k: v for k, v in header.metadata.items() if k != f"granitehybrid.{key}"}
    if value is not None:
        metadata[f"granitehybrid.{key}"] = value
    with pytest.raises(ValueError, match=f"granitehybrid.{key}.*{words}|{words}"):
        DecoderArgs.from_hf_config(hf_config_from_gguf(dataclasses.replace(header, metadata=metadata)))


def test_a_granitehybrid_files_tokenizer_converts_with_none_cached(tmp_path):
    """transformers' GGUF reader refuses a granitehybrid file's config, so its tokenizer is built from the
    `tokenizer.*` keys alone (as a qwen35 file's), not only found cached from another file of the same keys."""
    import gguf
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "granitehybrid")
    byte_tokens = bytes_to_unicode()  # byte b is token b, then one merge: a byte-level BPE of 258 tokens
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([byte_tokens[b] for b in range(256)] + ["Th", "<|endoftext|>"])
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
