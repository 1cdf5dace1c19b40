"""A random gpt-oss at gpt-oss-20b's layer shape, as the file people download for it (issue 65's speed check
against llama-server): a `GptOssForCausalLM` folder as the hub's checkpoint lays one out (bf16 tensors, the
experts in MXFP4 `_blocks` and `_scales` under the hub's quantization_config, gpt-oss's own o200k_harmony
tokenizer), converted by llama.cpp's own convert_hf_to_gguf.py (`--outtype bf16`: its experts stay MXFP4),
then quantized by its `llama-quantize` to MXFP4_MOE (experts MXFP4, the other matrices Q8_0, the router
and the 1-D tensors as converted).

    python scripts/write_gpt_oss_shape.py [--layers 4] [--folder bench_out] [--keep-bf16]
    # -> bench_out/gpt-oss-20b-shape-4l/ (the folder) and bench_out/gpt-oss-20b-shape-4l-mxfp4_moe.gguf
    python scripts/bench_gguf_1b.py --file bench_out/gpt-oss-20b-shape-4l-mxfp4_moe.gguf --int8 --distance

The config is gpt-oss-20b's config.json as recalled (no hub access where this was written: a key may differ
from the hub's file), but for its 24 layers: hidden 2880, 64 query heads and 8 KV heads of 64, 32 experts of
2880, 4 a token, sliding windows of 128 on the even layers, YaRN (factor 32 over 4096 positions, beta_fast 32,
beta_slow 1, truncate false), RoPE base 150000, swiglu_limit 7, 201088 vocabulary rows, untied lm_head.
Random weights: peaked as the tests' (tests/gguf_fuzz_files.py's peaked_init), the MXFP4 values' scales
chosen so that a row's products are of the float init's size, so that activations stay of unit size across
layers and the logits are spread. Needs scripts/setup.sh's converter and tokenizer source, and
scripts/build_llama_server.sh's llama-quantize. Writes ~4.1 GB of folder, ~4.2 GB of bf16 GGUF (removed
unless --keep-bf16) and 2.84 GiB of MXFP4_MOE GGUF at 4 layers (3.7 minutes on 2 cores); peak memory 5 GB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_llama_cpp import LLAMA_SERVER  # noqa: E402

CONVERTER = Path.home() / ".cache" / "coreserve" / "llama.cpp-convert-0.3.36"  # scripts/setup.sh extracts it
LLAMA_QUANTIZE = LLAMA_SERVER.parent / "llama-quantize"
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
# the e2m1 values a nibble holds; random nibbles' values have this root mean square
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
ROWS_A_CHUNK = 16384  # the vocabulary tables are drawn in chunks: no fp32 copy of a whole table


def config_of(num_layers: int) -> dict:
    """gpt-oss-20b's config.json (as recalled) at num_layers."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
        "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "num_local_experts": 32,
        "num_experts_per_tok": 4, "experts_per_token": 4, "num_hidden_layers": num_layers,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "sliding_window": 128, "initial_context_length": 4096, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False},
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088, "bos_token_id": 199998,
        "eos_token_id": 200002, "pad_token_id": 199999, "initializer_range": 0.02, "output_router_logits": False,
        "router_aux_loss_coef": 0.9, "use_cache": True, "torch_dtype": "bfloat16",
        "quantization_config": MXFP4_CONFIG,
    }


def float_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16 tensor of the tests' peaked init (tests/gguf_fuzz_files.py), drawn a chunk of rows at a time."""
    from gguf_fuzz_files import peaked_init

    out = torch.empty(shape, dtype=torch.bfloat16)
    for begin in range(0, shape[0], ROWS_A_CHUNK):
        rows = out[begin:begin + ROWS_A_CHUNK]
        rows.copy_(peaked_init(name, torch.empty(rows.shape, dtype=torch.float32)))
    return out


def mxfp4_pair(rng: np.random.Generator, experts: int, rows: int, columns: int, gain: float):
    """(blocks [experts, rows, columns / 32, 16], scales [experts, rows, columns / 32]) uint8, random nibbles
    under e8m0 scales of the two powers of two around gain / sqrt(columns) / rms(e2m1), as the float init's
    rows (peaked_init: gain 1, or 0.5 for down_proj)."""
    exponent = math.log2(gain / math.sqrt(columns) / math.sqrt(np.mean(E2M1 ** 2))) + 127
    groups = columns // 32
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(math.floor(exponent), math.floor(exponent) + 2, (experts, rows, groups), dtype=np.uint8)
    return torch.from_numpy(blocks), torch.from_numpy(scales)


def layer_tensors(config: dict, layer: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors by the hub checkpoint's names."""
    hidden, width, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "self_attn.q_proj.weight": (q_rows, hidden), "self_attn.q_proj.bias": (q_rows,),
        "self_attn.k_proj.weight": (kv_rows, hidden), "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.o_proj.weight": (hidden, q_rows), "self_attn.o_proj.bias": (hidden,),
        "self_attn.sinks": (config["num_attention_heads"],),
        "mlp.router.weight": (experts, hidden), "mlp.router.bias": (experts,),
        "mlp.experts.gate_up_proj_bias": (experts, 2 * width), "mlp.experts.down_proj_bias": (experts, hidden),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
    }
    prefix = f"model.layers.{layer}."
    tensors = {prefix + name: float_tensor(prefix + name, shape) for name, shape in shapes.items()}
    for module, rows, columns, gain in (("gate_up_proj", 2 * width, hidden, 1.0), ("down_proj", hidden, width, 0.5)):
        blocks, scales = mxfp4_pair(rng, experts, rows, columns, gain)
        tensors[f"{prefix}mlp.experts.{module}_blocks"] = blocks
        tensors[f"{prefix}mlp.experts.{module}_scales"] = scales
    return tensors


def write_folder(folder: Path, config: dict, seed: int) -> None:
    """The checkpoint in shards (the tables, then one a layer) with their index, the config and the tokenizer."""
    from real_tokenizers import real_tokenizer_path
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, hidden, num_layers = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    shards = [lambda: {"model.embed_tokens.weight": float_tensor("model.embed_tokens.weight", (vocab, hidden))},
              lambda: {"lm_head.weight": float_tensor("lm_head.weight", (vocab, hidden)),
                       "model.norm.weight": float_tensor("model.norm.weight", (hidden,))}]
    shards += [lambda layer=layer: layer_tensors(config, layer, rng) for layer in range(num_layers)]
    weight_map, total = {}, 0
    for index, make in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = make()
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"wrote {name}", flush=True)
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for item in Path(real_tokenizer_path("o200k_harmony")).iterdir():
        shutil.copyfile(item, folder / item.name)


def convert(folder: Path, out: Path) -> None:
    """llama.cpp's converter on the folder, bf16 out (the folder's values as they are; experts kept MXFP4)."""
    if not (CONVERTER / "convert_hf_to_gguf.py").exists():
        raise SystemExit(f"llama.cpp's converter is not at {CONVERTER}: run scripts/setup.sh --test")
    env = dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"), HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16",
                    "--outfile", str(out)], env=env, check=True)


def quantize(source: Path, out: Path) -> None:
    if not LLAMA_QUANTIZE.exists():
        raise SystemExit(f"{LLAMA_QUANTIZE} is missing: build it with scripts/build_llama_server.sh")
    partial = out.with_suffix(".part")
    subprocess.run([str(LLAMA_QUANTIZE), str(source), str(partial), "MXFP4_MOE", str(os.cpu_count() or 1)],
                   check=True, stdout=subprocess.DEVNULL)
    os.replace(partial, out)


def _kind(name: str, num_dims: int) -> str:
    if name.endswith("_exps.weight"):
        return "expert matrices"
    if name.endswith("ffn_gate_inp.weight"):
        return "routers"
    return "other matrices" if num_dims > 1 and name.endswith(".weight") else "vectors and biases"


def describe(path: Path) -> str:
    """The file's size and its tensors' count by kind and ggml type."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    kinds = Counter((_kind(t.name, len(t.shape)), t.tensor_type.name) for t in reader.tensors)
    listed = ", ".join(f"{kind} {type_name} x {count}" for (kind, type_name), count in sorted(kinds.items()))
    return f"{path} ({path.stat().st_size / 2**30:.2f} GiB): {listed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (gpt-oss-20b has 24)")
    parser.add_argument("--folder", default=str(ROOT / "bench_out"), help="where the folder and files go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-bf16", action="store_true", help="keep the converter's bf16 file")
    args = parser.parse_args()
    if args.layers < 1:
        raise ValueError(f"--layers={args.layers}: at least 1")
    stem = f"gpt-oss-20b-shape-{args.layers}l"
    base = Path(args.folder)
    folder, bf16, out = base / stem, base / f"{stem}-bf16.gguf", base / f"{stem}-mxfp4_moe.gguf"
    if not (folder / "config.json").exists():  # config.json written last: its presence marks a whole folder
        write_folder(folder, config_of(args.layers), args.seed)
    if not out.exists():
        if not bf16.exists():
            convert(folder, bf16)
        quantize(bf16, out)
        if not args.keep_bf16:
            bf16.unlink()
    print(describe(out))


if __name__ == "__main__":
    main()
