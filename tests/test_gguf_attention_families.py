"""GGUF files of issue 65's attention families as llama.cpp's own converter writes them (its convert_hf_to_gguf.py,
run in a subprocess from the folder scripts/setup.sh extracts, kept by their input's digest) from the random family
models: `olmo2` (OLMo 2; OLMo 3 too, whose file is an olmo2 one with sliding-window keys), `smollm3` (llama's
layout, q/k rows interleaved, its NoPE layer fixed in llama.cpp's code) and `exaone4`. The f32 file gives HF
transformers' logprobs on the folder, its config read back as the folder's (layer kinds, the sliding layers' own
RoPE, no window where the file has none); the Q8_0 file kept in its blocks gives the bits of the same file
dequantized, alone and batched; a window pattern that does not fit is a ValueError naming its key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
from coreserve.worker.models.gguf_config import hf_config_from_gguf
from coreserve.worker.models.loader import read_config

SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
# family -> (the HF architecture its file reads back as, its layer_types, its sliding_window): an architecture
# that may have windows says every layer is global where its file has none
EXPECTED = {
    "olmo2": ("Olmo2ForCausalLM", ["full_attention"] * 2, None),
    "olmo3": ("Olmo3ForCausalLM", SLIDING_THEN_FULL, 24),
    "smollm3": ("SmolLM3ForCausalLM", None, None),
    "exaone4": ("Exaone4ForCausalLM", SLIDING_THEN_FULL, 24),
}


@pytest.fixture(scope="module")
def converted(family_model, tmp_path_factory):
    """converted(family) -> {"f32": ..., "q8_0": ...}: the family folder's files, written by the converter at once."""
    made: dict[str, dict[str, str]] = {}

    def get(family: str) -> dict[str, str]:
        if family not in made:
            source = Path(family_model(family))
            made[family] = convert({"f32": (source, []), "q8_0": (source, [])}, tmp_path_factory.mktemp(family))
        return made[family]

    return get


@needs_converter
@pytest.mark.parametrize("family", list(EXPECTED))
def test_converted_gguf_gives_hfs_logprobs_and_its_blocks_their_dequantizations_bits(family, converted, family_model):
    if family == "smollm3" and importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter imports sentencepiece for llama's layout (pip install -e '.[test]')")
    files = converted(family)
    config = read_config(files["f32"])
    architecture, layer_types, window = EXPECTED[family]
    assert config["architectures"] == [architecture] and config.get("layer_types") == layer_types
    assert config.get("sliding_window") == window
    if family == "olmo3":  # the sliding layers' own base, unscaled; the global layers' YaRN
        assert config["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
        assert config["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    outputs, _ = run(files["f32"], "float32", alone=False)
    assert_gives_hfs_logprobs(outputs, load_hf(family_model(family)))
    assert_blocks_give_fp32s_bits(files["q8_0"], {"layers.0.qkv_proj", "layers.1.gate_up_proj", "layers.1.o_proj"})


@needs_converter
@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("attention.sliding_window_pattern", np.array([True, False, True]), "a bool for each of the 2 layers"),
        ("attention.sliding_window_pattern", 0, "must be a positive integer"),
        ("rope.freq_base_swa", -1.0, "must be a positive number"),
        ("attention.sliding_window_pattern", [1.0, 0.0], "a bool for each"),  # floats: not llama.cpp's flags
        ("exaone4:rope.freq_base_swa", 10000.0, "not supported: exaone4 rotates every layer alike"),
    ],
)
def test_bad_window_keys_are_value_errors_naming_them(converted, key, value, words):
    arch, _, key = key.rpartition(":")
    arch = arch or "olmo2"
    header = read_gguf_header(converted({"olmo2": "olmo3"}.get(arch, arch))["f32"])
    metadata = {**header.metadata, f"{arch}.{key}": value}
    with pytest.raises(ValueError, match=f"{arch}.{key}.*{words}"):
        hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))


@needs_converter
def test_a_rope_factor_without_a_scaling_type_scales_linearly_as_in_llama_cpp(converted):
    """llama.cpp's type where rope.scaling.type is absent is linear (it was ignored here; the untrusted-input
    fuzzer's)."""
    header = read_gguf_header(converted("exaone4")["f32"])
    metadata = {**header.metadata, "exaone4.rope.scaling.factor": 4.0}
    config = hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))
    assert config["rope_parameters"] == {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}


@needs_converter
def test_a_file_without_a_window_has_every_layer_global(converted):
    """As the converter writes a folder whose sliding_window is null (and llama.cpp reads it): no window, and
    not the sliding layers Exaone 4's HF config would derive from its default pattern (found by the fuzzer)."""
    from coreserve.worker.models.config import DecoderArgs

    header = read_gguf_header(converted("exaone4")["f32"])
    metadata = {k: v for k, v in header.metadata.items() if not k.startswith("exaone4.attention.sliding_window")}
    config = hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))
    assert config["sliding_window"] is None and config["layer_types"] == ["full_attention"] * 2
    assert all(layer.attention.window is None for layer in DecoderArgs.from_hf_config(config).layers)
