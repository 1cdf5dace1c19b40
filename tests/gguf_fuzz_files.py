"""The files of a fuzz case (tests/gguf_fuzz.py): a random-weight Hugging Face folder of its config, the
GGUF that llama.cpp's converter and llama-quantize would make of it (each tensor in the type the case asks
for, or llama-quantize's fallback where its rows are not whole blocks), and the safetensors twin that holds
the GGUF's dequantized values under the same config, for transformers to load.

The `gguf` package quantizes values to F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; it has no K-quant
quantizer, so a K-quant tensor is random blocks whose fp16 scales are set for the tensor's spread (mean
about 0, the HF init's standard deviation). A LLAMA_QUANTIZE case's file is the real llama-quantize's
output of its F32 file, read back with gguf's reader. Either way the values a correct reader gives are
gguf's numpy dequantization of the stored bytes. A hybrid or issue-65 family's file is llama.cpp's converter's,
re-typed (gguf_fuzz_convert.py); its folder has the GPT-2 tokenizer, which the converter needs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf_families import ARCHS, _gguf_name, _metadata
from gguf_files import K_SCALE_FIELDS, interleave_heads
from gguf_fuzz import CONVERTED_FAMILIES, K_TYPES, LLAMA_QUANTIZE, FuzzCase, fitted_type
from gguf_fuzz_attention import init_scale
from gguf_fuzz_hybrid import hub_config, scales_by_one_plus

# family -> (GGUF architecture, general.name): llama.cpp writes Mistral as `llama` named so
_ARCHS = {**ARCHS, "llama": ("llama", "t"), "mistral": ("llama", "mistral t"), "qwen2": ("qwen2", "t"),
          "qwen3": ("qwen3", "t")}
# where scripts/build_llama_server.sh builds llama.cpp's quantizer
DEFAULT_LLAMA_QUANTIZE = Path.home() / ".cache" / "coreserve" / "llama.cpp-0.3.36" / "build" / "bin" / "llama-quantize"


@dataclass(frozen=True)
class CaseFiles:
    gguf: str
    twin: str  # the safetensors twin's folder
    types: dict[str, tuple[str, str]]  # GGUF tensor name -> (type asked for, type written), 2-D ones


def write_case(case: FuzzCase, folder: Path, llama_quantize: str | None = None) -> CaseFiles:
    """The case's GGUF file and its safetensors twin, under `folder`; `llama_quantize`: the binary that
    quantizes a LLAMA_QUANTIZE case's F32 file."""
    from safetensors.numpy import load_file, save_file

    source = folder / "source"
    _write_source(case, source)
    path = folder / f"{case.name.replace(':', '-')}.gguf"
    tensors = load_file(str(source / "model.safetensors"))
    if case.family in CONVERTED_FAMILIES:
        from gguf_fuzz_convert import write_converted  # it imports encode from here

        expected, types = write_converted(case, source, tensors, path, llama_quantize)
    elif case.weight_type in LLAMA_QUANTIZE:
        assert llama_quantize is not None, f"{case.name}: no llama-quantize binary given"
        expected, types = write_llama_quantized(case, tensors, path, llama_quantize)
    else:
        expected, types = write_gguf(case, tensors, path)
    twin = folder / "twin"
    twin.mkdir(parents=True, exist_ok=True)
    save_file(expected, str(twin / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(source / "config.json", twin / "config.json")
    return CaseFiles(str(path), str(twin), types)


def _write_source(case: FuzzCase, folder: Path) -> None:
    """transformers' model of the config, peaked random weights (logit spreads of several units); a converted
    family's with the GPT-2 tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = dict(case.config)
    config = AutoConfig.for_model(keys.pop("model_type"), **keys)
    torch.manual_seed(case.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = init_scale(case.config, name)
            param.copy_(scale * peaked_init(name, param) - float(scales_by_one_plus(case.config, name)))
    model.save_pretrained(str(folder))
    if case.family in CONVERTED_FAMILIES:
        from coreserve.protocol.builtin_model import make_tokenizer

        make_tokenizer().save_pretrained(str(folder))
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(hub_config(saved), indent=2))


def peaked_init(name: str, param):
    """The family models' init (conftest.py's and the fuzzer's): norms near 1, logits spread enough that
    greedy choices are not near ties."""
    import torch

    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn_like(param)
    if name.endswith("bias"):
        return 0.1 * torch.randn_like(param)
    if "embed_tokens" in name:
        return torch.randn_like(param)
    scale = 5.0 if "lm_head" in name else 0.5 if ("o_proj" in name or "down_proj" in name) else 1.0
    return scale * param.shape[-1] ** -0.5 * torch.randn_like(param)  # [..., out, in]: HF's 3-D experts too


def write_gguf(case: FuzzCase, tensors: dict[str, np.ndarray], path: Path) -> tuple[dict, dict]:
    """`tensors` (HF names, fp32) as llama.cpp's converter writes the architecture, each 2-D tensor in its
    fitted type. Returns the HF-named values a correct reader gives, and each 2-D tensor's types."""
    import gguf

    arch = _ARCHS[case.family][0]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, case, tensors)
    rng = np.random.default_rng(case.seed)
    expected, types, experts = {}, {}, {}
    for hf, values in sorted(tensors.items()):
        target = _gguf_name(hf, arch)
        if target.startswith("expert:"):  # stacked below, per layer and role, in expert order
            experts.setdefault(target.removeprefix("expert:"), {})[int(hf.split(".")[5])] = (hf, values)
        elif not (case.config["tie_word_embeddings"] and hf == "lm_head.weight"):
            expected[hf] = _add_tensor(writer, case, hf, target, values, types, rng)
    for target, by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e][1] for e in sorted(by_expert)])  # [experts, rows, columns]
        kind = _fitted(case, target, stacked, types)
        stored, value = encode(stacked.reshape(-1, stacked.shape[-1]), kind, rng)
        expected.update({by_expert[e][0]: value.reshape(stacked.shape)[e] for e in sorted(by_expert)})
        writer.add_tensor(target, stored.reshape(len(by_expert), stacked.shape[1], -1),
                          raw_dtype=gguf.GGMLQuantizationType[kind])
    rope = case.config["rope_parameters"]
    for key in ("long_factor", "short_factor") if "long_factor" in rope else ():  # LongRoPE's, as tensors
        writer.add_tensor(f"rope_factors_{key.split('_')[0]}.weight", np.asarray(rope[key], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected, types


def _write_metadata(writer, case: FuzzCase, tensors: dict[str, np.ndarray]) -> None:
    """gguf_families' metadata, and YaRN's keys (which it has no family for)."""
    import gguf

    arch, name = _ARCHS[case.family]
    _metadata(writer, arch, name, case.config, tensors)
    rope = case.config["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _add_tensor(writer, case: FuzzCase, hf: str, target: str, values: np.ndarray, types: dict, rng) -> np.ndarray:
    """One tensor (not an expert's) into the writer, in its fitted type (norms, biases and a router F32;
    Gemma's norms as 1 + w; llama's q/k rows interleaved). Returns its values as a reader gives them."""
    from gguf import GGMLQuantizationType

    arch = _ARCHS[case.family][0]
    is_gemma_norm = arch.startswith("gemma") and hf.endswith("norm.weight")
    values = values + np.float32(1.0) if is_gemma_norm else values  # llama.cpp's; a reader takes 1 off
    kind = "F32" if values.ndim == 1 or "gate_inp" in target else _fitted(case, target, values, types)
    stored, value = encode(values.reshape(-1, values.shape[-1]), kind, rng)
    heads = {"attn_q": case.config["num_attention_heads"], "attn_k": case.config["num_key_value_heads"]}
    if arch == "llama" and target.split(".")[-2] in heads:
        stored = interleave_heads(stored.reshape(values.shape[0], -1), heads[target.split(".")[-2]])
    writer.add_tensor(target, stored.reshape(*values.shape[:-1], -1), raw_dtype=GGMLQuantizationType[kind])
    value = value.reshape(values.shape)
    return value - np.float32(1.0) if is_gemma_norm else value


def _fitted(case: FuzzCase, target: str, values: np.ndarray, types: dict) -> str:
    """The tensor's type after llama-quantize's fallback, recorded in `types` beside the one asked for."""
    asked = case.requested_type(target, case.config["num_hidden_layers"])
    types[target] = (asked, fitted_type(asked, values.shape[-1]))
    return types[target][1]


def encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """values [rows, columns] fp32 -> (the bytes or floats stored in ggml type `kind`, their fp32 values)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    if kind in K_TYPES:
        stored = random_k_blocks(values.shape, kind, float(values.std()), rng)
    else:
        stored = quants.quantize(values.astype(np.float32), qtype)
    return stored, quants.dequantize(stored, qtype).reshape(values.shape).astype(np.float32)


def random_k_blocks(shape: tuple[int, int], kind: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] uint8 of random K-quant super-blocks whose values have mean about 0 and standard
    deviation about `std`: random quants and sub-block scales, each block's fp16 d (and dmin) drawn
    around the values that give that spread (the values are linear in d and in dmin)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, num_blocks = shape[0], shape[1] // block_size
    blocks = rng.integers(0, 256, (rows, num_blocks, type_size), dtype=np.uint8)
    fields = K_SCALE_FIELDS[kind]  # (d,) or (d, dmin)
    draws = rng.uniform(0.5, 1.5, (len(fields), rows, num_blocks))

    def values_with(factors: list[float]) -> np.ndarray:
        for offset, draw, factor in zip(fields, draws, factors):
            scales = (draw * factor).astype(np.float16)
            blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, num_blocks, 2)
        return quants.dequantize(blocks.reshape(rows, -1), qtype).astype(np.float64)

    if len(fields) == 2:  # d's part and dmin's part apart: dmin's weight sets the mean to about 0
        d_part, dmin_part = values_with([1.0, 0.0]), values_with([0.0, 1.0])
        shift = -d_part.mean() / dmin_part.mean() if dmin_part.mean() else 0.0
        spread = (d_part + shift * dmin_part).std()
        values_with([std / spread, shift * std / spread])
    else:
        values_with([std / values_with([1.0]).std()])
    return blocks.reshape(rows, -1)


def write_llama_quantized(
    case: FuzzCase, tensors: dict[str, np.ndarray], path: Path, llama_quantize: str
) -> tuple[dict, dict]:
    """The case's F32 GGUF, quantized by llama.cpp's own llama-quantize with the case's recipe (its real
    choice of type a tensor). Returns what write_gguf returns, read back from the quantized file."""
    import subprocess

    f32 = path.with_name(path.stem + "-f32.gguf")
    write_gguf(case, tensors, f32)  # every 2-D tensor F32: a LLAMA_QUANTIZE case asks for nothing else
    ftype = case.weight_type.split(":")[1]
    done = subprocess.run([llama_quantize, str(f32), str(path), ftype], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-quantize {ftype} failed: {done.stderr.strip().splitlines()[-1:]}")
    return read_gguf_values(case, tensors, path)


def read_gguf_values(case: FuzzCase, tensors: dict[str, np.ndarray], path: Path) -> tuple[dict, dict]:
    """A GGUF of the case's model read back with gguf's own reader and dequantization (not the engine's):
    the HF-named fp32 values, q/k rows back in HF's order, experts apart, Gemma's norms less 1."""
    import gguf

    arch = _ARCHS[case.family][0]
    hf_names: dict[str, list[str]] = {}  # GGUF name -> its HF names (an experts tensor's in expert order)
    for hf in sorted(tensors, key=lambda n: int(n.split(".")[5]) if ".experts." in n else 0):
        hf_names.setdefault(_gguf_name(hf, arch).removeprefix("expert:"), []).append(hf)
    heads = {"attn_q": case.config["num_attention_heads"], "attn_k": case.config["num_key_value_heads"]}
    expected, types = {}, {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.name not in hf_names:  # LongRoPE's factors: config
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        role = tensor.name.split(".")[-2]
        if values.ndim > 1 and "gate_inp" not in tensor.name:
            types[tensor.name] = (case.weight_type, tensor.tensor_type.name)
        if arch == "llama" and role in heads:  # interleave_heads undone
            half = values.shape[0] // heads[role] // 2
            values = values.reshape(heads[role], half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        if arch.startswith("gemma") and tensor.name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        for index, hf in enumerate(hf_names[tensor.name]):
            expected[hf] = np.ascontiguousarray(values[index] if values.ndim == 3 else values)
    return expected, types
