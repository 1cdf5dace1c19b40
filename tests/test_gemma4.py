"""Gemma 4's text decoder beyond the family tests (test_model_families.py runs it against HF): the hub's
layout (`Gemma4ForConditionalGeneration`, the decoder under text_config, its towers skipped by name: the same model), HF's
reading of its config (the last layer global, its RoPE per kind where absent), and what HF's class holds
that the engine does not build, refused by name at load, one key each.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coreserve import LLM
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.family import FULL, SLIDING
from coreserve.worker.models.loader import load_model


def _config(family_model) -> dict:
    return json.loads((Path(family_model("gemma4")) / "config.json").read_text())


def test_gemma4_hub_layout_gives_the_same_model(family_model, tmp_path):
    """The hub's folders: the decoder's config in text_config, its tensors under model.language_model., the
    vision and audio towers and their embedders skipped by name: the text-only folder's arguments and
    tensors, bit for bit (the forward reads nothing else)."""
    source = Path(family_model("gemma4"))
    text = _config(family_model)
    del text["architectures"]
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
              "text_config": text, "vision_config": {"hidden_size": 8}, "audio_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in
               load_file(str(source / "model.safetensors")).items()}
    for tower in ("vision_tower.encoder.layers.0.mlp.up_proj", "audio_tower.layers.0.lconv1d.linear_start",
                  "embed_vision.embedding_projection", "embed_audio.embedding_projection"):
        tensors[f"model.{tower}.weight"] = torch.zeros(8, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    expected = load_model(str(source), torch.float32, torch.device("cpu"))
    got = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert dataclasses.replace(got.args, text_prefix="model.") == expected.args
    theirs = dict(expected.state_dict())
    assert {name: torch.equal(t, theirs[name]) for name, t in got.state_dict().items()} == dict.fromkeys(theirs, True)


def test_gemma4_config_is_read_as_hf_reads_it(family_model):
    """HF's Gemma 4 makes the last layer global whatever layer_types says; without rope_parameters, its
    defaults: the local layers' default RoPE (base 1e4), the global ones' proportional (a quarter, 1e6)."""
    config = _config(family_model)
    # "vision": image tokens see each other both ways, text is causal (HF's Gemma4Model; no images here)
    args = DecoderArgs.from_hf_config({**config, "layer_types": [SLIDING, SLIDING],
                                       "use_bidirectional_attention": "vision"})
    assert [spec.attention.window for spec in args.layers] == [24, None]
    del config["rope_parameters"]
    args = DecoderArgs.from_hf_config(config)
    local, world = args.layers[0].rope, args.layers[1].rope
    assert (local.rope_type, local.theta, world.rope_type, world.theta) == ("default", 1e4, "proportional", 1e6)
    assert world.params["partial_rotary_factor"] == 0.25 and world.head_dim == 32
    assert [spec.attention.scale for spec in args.layers] == [1.0, 1.0] and args.final_softcap == 8.0
    assert FULL in config["layer_types"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size_per_layer_input": 256}, "per-layer embeddings"),
        ({"hidden_size_per_layer_input": None, "drop": "hidden_size_per_layer_input"}, "per-layer embeddings"),
        ({"num_kv_shared_layers": 1}, "KV sharing"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}, "mixture-of-experts"),
        ({"attention_k_eq_v": True}, "keys as values"),
        ({"use_bidirectional_attention": "all"}, "bidirectional attention"),
        ({"global_head_dim": 64, "drop": "per_layer_config"}, "global_head_dim must be head_dim"),
        ({"drop": "per_layer_config"}, "global_head_dim must be head_dim"),  # HF's default: 512
        ({"per_layer_config": {"1": {"head_dim": 64}}}, "per-layer attention shapes"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ],
)
def test_gemma4_beyond_the_body_is_refused_by_name(change, message, family_model):
    config = {**_config(family_model), **change}
    config.pop(config.pop("drop", None), None)
    with pytest.raises(ValueError, match=message):
        DecoderArgs.from_hf_config(config)


def test_gemma4_refusal_is_a_value_error_at_load(family_model, tmp_path):
    source = Path(family_model("gemma4"))
    for item in source.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item)
    (tmp_path / "config.json").write_text(json.dumps({**_config(family_model), "num_kv_shared_layers": 1}))
    with pytest.raises(ValueError, match="KV sharing"):
        LLM(str(tmp_path), multiprocess=False)
