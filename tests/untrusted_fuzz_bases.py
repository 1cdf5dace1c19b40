"""The valid inputs the untrusted-input fuzzer mutates (tests/untrusted_mutation.py's `Bases`), made once
under a cache folder and reused: a small llama GGUF (tests/gguf_files.py's model with a 512-token vocabulary,
F32 but one Q8_0 tensor, so that dtype "auto" keeps blocks), a PEFT adapter for the built-in tiny model, and
the tiny model's own folder; and three hybrids (issue 64), each a random 2-layer HF folder with the tiny model's
GPT-2 tokenizer (one llama.cpp's converter knows) and the f32 GGUF file that converter writes of it (run in a
subprocess, as tests/test_gguf_hybrid.py runs it): Qwen3-Next (a Gated DeltaNet layer, then full attention,
each over 8 experts and a shared one), LFM2 (a short conv layer, then attention) and Granite 4.0-H (a Mamba2
layer, then NoPE attention; tests/conftest.py's granitemoehybrid shape); and issue 65's attention families the
same way: gpt-oss (a sliding layer then a full one, sinks, 4 experts in MXFP4 as the hub's folders hold them: its
GGUF keeps them in MXFP4), OLMo 3 (a sliding layer with its own RoPE, a global one under YaRN), SmolLM3 (four
layers, the fourth NoPE), Exaone 4 (a sliding layer, a NoPE global one) and Gemma 4's text decoder (a folder
only: llama.cpp's converter has no gemma4 text file). Runs in the fuzzer's child process (PEFT needs torch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from untrusted_mutation import Bases

LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]
CONVERTER = "llama.cpp-convert-0.3.36"  # under coreserve's cache folder: scripts/setup.sh --test extracts it
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="silu",
              vocab_size=50304, bos_token_id=50256, eos_token_id=50256)  # the GPT-2 tokenizer's, padded to 64
# tests/conftest.py's qwen3_next and lfm2 family shapes
HYBRID_CONFIGS = {
    "next": dict(
        model_type="qwen3_next", head_dim=32, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    "lfm2": dict(
        model_type="lfm2", layer_types=["conv", "full_attention"], conv_L_cache=3, block_multiple_of=32,
        norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # the hub's layer names (the converter knows `mamba` / `attention`, not HF's newer ones)
    "granite": dict(
        model_type="granitemoehybrid", num_attention_heads=2, layer_types=["mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
        num_local_experts=0, shared_intermediate_size=96, position_embedding_type="nope",
        embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.09, logits_scaling=1.6,
    ),
}
_SLIDING_FULL = ["sliding_attention", "full_attention"]
# issue 65's families, tests/conftest.py's shapes (gpt-oss's clamp and YaRN as llama.cpp fixes them)
ATTENTION_CONFIGS = {
    "gpt_oss": dict(
        model_type="gpt_oss", head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=_SLIDING_FULL, swiglu_limit=7.0, attention_bias=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=True, original_max_position_embeddings=32),
    ),
    "olmo3": dict(
        model_type="olmo3", sliding_window=8, layer_types=_SLIDING_FULL, rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=8.0,
                                   original_max_position_embeddings=32)},
    ),
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, pad_token_id=0),
    "exaone4": dict(model_type="exaone4", head_dim=16, sliding_window=8, layer_types=_SLIDING_FULL,
                    rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "gemma4": dict(
        model_type="gemma4_text", head_dim=16, global_head_dim=16, sliding_window=8, pad_token_id=0,
        hidden_size_per_layer_input=0, final_logit_softcapping=8.0, layer_types=_SLIDING_FULL, rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="proportional", rope_theta=1000000.0, partial_rotary_factor=0.25)},
    ),
}
FOLDER_CONFIGS = {**HYBRID_CONFIGS, **ATTENTION_CONFIGS}
_CONVERTER_FLAGS = {"next": ["--no-mtp"]}  # LFM2's and Granite's converters (and others) refuse --no-mtp
_FOLDER_ONLY = ("gemma4",)  # no GGUF text architecture in llama.cpp's converter


def make_bases(cache_dir: Path) -> Bases:
    from coreserve.protocol.builtin_model import builtin_model_path

    tiny = builtin_model_path("tiny")
    gguf = _made(cache_dir / "base.gguf", _write_gguf)
    lora = _made(cache_dir / "adapter", lambda path: _write_adapter(tiny, path))
    others = {}
    for name in FOLDER_CONFIGS:
        folder = _made(cache_dir / f"{name}-hf", lambda path, name=name: _write_folder(name, tiny, path))
        others[f"{name}_hf"] = str(folder)
        if name not in _FOLDER_ONLY:
            others[f"{name}_gguf"] = str(_made(cache_dir / f"{name}.gguf", lambda path, name=name, folder=folder:
                                               _convert(folder, path, _CONVERTER_FLAGS.get(name, []))))
    return Bases(gguf=str(gguf), hf=tiny, lora=str(lora), **others)


def _made(path: Path, write: Callable[[Path], None]) -> Path:
    """`path`, written by `write` unless there; atomic, so a run cut short leaves no half-made base."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        write(tmp / path.name)
        os.rename(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_gguf(path: Path) -> None:
    from gguf_files import write_gguf_model

    write_gguf_model(path, {"model.layers.0.mlp.down_proj.weight": "Q8_0"}, "F32", vocab_size=512)


def _write_adapter(base: str, path: Path) -> None:
    """PEFT's adapter of rank 2 (alpha 4), random A and B, saved as PEFT saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(path))


def _write_folder(name: str, tiny: str, path: Path) -> None:
    """A random checkpoint of FOLDER_CONFIGS[name] as transformers saves it, with the tiny model's tokenizer;
    its layer_types as given (transformers saves Granite's `mamba` / `attention` under its own names, which
    llama.cpp's converter does not know; the hub's folders say `mamba` / `attention`); gpt-oss's experts MXFP4."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    spec = {**_SMALL, **FOLDER_CONFIGS[name]}
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.float32).save_pretrained(str(path))
    saved = json.loads((path / "config.json").read_text())
    if "layer_types" in spec:
        (path / "config.json").write_text(json.dumps({**saved, "layer_types": spec["layer_types"]}, indent=2))
    if spec["model_type"] == "gpt_oss":
        _mxfp4_experts(path)
    for item in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny) / item, path / item)


def _mxfp4_experts(path: Path) -> None:
    """The folder's float experts replaced by random MXFP4 ones as the hub's gpt-oss holds them: `_blocks`
    [experts, rows, columns / 32, 16] uint8 and `_scales` [experts, rows, columns / 32] uint8 (e8m0, 2^(e - 127),
    e in 118..125), config.json's quantization_config as transformers writes it (tests/conftest.py's)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for name, values in load_file(str(path / "model.safetensors")).items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = values
            continue
        experts, num_in, num_out = values.shape  # HF's [experts, in, out]
        shape = (experts, num_out, num_in // 32)
        tensors[name + "_blocks"] = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(118, 126, shape, dtype=np.uint8)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}, indent=2))


def _convert(folder: Path, path: Path, flags: list[str]) -> None:
    """The f32 GGUF file llama.cpp's own converter writes of `folder`."""
    from coreserve.protocol.builtin_model import default_cache_dir

    converter = default_cache_dir() / CONVERTER
    if not (converter / "convert_hf_to_gguf.py").exists():
        raise FileNotFoundError(f"llama.cpp's converter is not at {converter}: run `bash scripts/setup.sh --test`")
    env = dict(os.environ, PYTHONPATH=str(converter / "gguf-py"), HF_HUB_OFFLINE="1")
    command = [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
               "--outfile", str(path), *flags]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        log = done.stdout[-2000:] + done.stderr[-2000:]
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{log}")
