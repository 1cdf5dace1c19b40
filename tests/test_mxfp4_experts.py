"""gpt-oss folders with MXFP4 experts (quantization_config's mxfp4, the hub's `_blocks` and `_scales`;
coreserve/worker/models/mxfp4_experts.py): the random gpt_oss family model with random MXFP4 experts gives HF
transformers' logprobs on the same folder (transformers dequantizes MXFP4 on a CPU), its experts kept in blocks
give the bits of the folder dequantized at load, alone and batched; a block whose values overflow, a part of the
wrong shape or without its scales, and the quantization configs not built are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import MXFP4_CONFIG, load_hf, write_family_model, write_mxfp4_experts
from safetensors.torch import load_file, save_file
from test_gguf_families import numbers
from test_gguf_hybrid import assert_gives_hfs_logprobs, run

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.loader import load_model
from coreserve.worker.models.quantized import MXFP4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The gpt_oss family model in float32 (whatever the suite's dtype: both sides' experts are fp32 values),
    its experts MXFP4."""
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    write_family_model(path, "gpt_oss")
    write_mxfp4_experts(path)
    return path


def test_mxfp4_experts_give_hfs_logprobs_and_kept_in_blocks_their_dequantizations_bits(folder):
    kept: list[str] = []
    batched, alone = run(str(folder), "auto", kept)
    assert {f"layers.{i}.moe.experts.{e}.{m}" for i in (0, 1) for e in range(4) for m in ("gate_up_proj", "down_proj")
            } == set(kept)
    fp32_batched, fp32_alone = run(str(folder), "float32")
    assert numbers(batched) == numbers(fp32_batched) and numbers(alone) == numbers(fp32_alone)
    assert_gives_hfs_logprobs(fp32_batched, load_hf(str(folder)))


def _rewrite(folder: Path, copy: Path, change) -> str:
    """A copy of `folder` whose tensors `change` edits in place (a dict of them)."""
    copy.mkdir()
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (copy / item.name).symlink_to(item)
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return str(copy)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")  # gguf's numpy, dequantizing the block
def test_a_block_whose_values_overflow_is_refused_naming_its_weight_kept_or_dequantized(folder, tmp_path):
    """Scale byte 255 (e8m0's NaN; 2^128 to ggml, gguf and transformers) with a nibble of 1.0: an infinity."""
    def overflow(tensors):
        tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 0] = 255
        tensors["model.layers.1.mlp.experts.down_proj_blocks"][2, 5, 0, 3] = 0x22

    path = _rewrite(folder, tmp_path / "overflow", overflow)
    for dtype in ("auto", "float32"):
        with pytest.raises(ValueError, match=r"weight layers\.1\.moe\.experts\.2\.down_proj\.weight holds NaN or inf"):
            load_model(path, dtype, torch.device("cpu"))


def test_parts_of_the_wrong_shape_or_dtype_or_without_scales_are_refused_by_name(folder, tmp_path):
    cases = {
        "shape": (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 64, 4, 8,
                  dtype=torch.uint8)}), r"gate_up_proj_blocks has shape \[4, 64, 4, 8\]; .* \[4, 64, 2, 16\]"),
        "dtype": (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales": torch.zeros(4, 64, 1)}),
                  r"down_proj_scales has dtype torch.float32; MXFP4 scales are uint8"),
        "alone": (lambda t: t.pop("model.layers.1.mlp.experts.gate_up_proj_scales"),
                  r"gate_up_proj_blocks has no model\.layers\.1\.mlp\.experts\.gate_up_proj_scales"),
        "float": (lambda t: t.update({"model.layers.0.mlp.experts.down_proj": torch.zeros(4, 32, 64)}),
                  r"model\.layers\.0\.mlp\.experts\.down_proj has no place"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_model(_rewrite(folder, tmp_path / name, change), "auto", torch.device("cpu"))


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "fp8"}, r"quantization_config\.quant_method='fp8' is not supported for gpt_oss"),
    ({**MXFP4_CONFIG, "modules_to_not_convert": ["model.layers.1.mlp.experts"]},
     r"modules_to_not_convert entry 'model\.layers\.1\.mlp\.experts' is not supported"),
    ({**MXFP4_CONFIG, "dequantize": True}, r"quantization_config\.dequantize is not supported"),
])
def test_quantization_configs_not_built_are_refused_by_name(folder, quantization, message):
    config = json.loads((folder / "config.json").read_text())
    assert DecoderArgs.from_hf_config(config).moe.is_mxfp4 and MXFP4 == 39
    with pytest.raises(ValueError, match=message):
        DecoderArgs.from_hf_config({**config, "quantization_config": quantization})


@pytest.mark.parametrize("key", ["intermediate_size", "hidden_size"])
def test_mxfp4_experts_over_widths_that_are_not_whole_blocks_are_refused_by_name(folder, key):
    """An assertion in the blocks' module before (the untrusted-input fuzzer: intermediate_size 1)."""
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=f"{key}=48 is not a multiple of 32"):
        DecoderArgs.from_hf_config({**config, key: 48})
