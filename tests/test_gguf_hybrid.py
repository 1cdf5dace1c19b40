"""Qwen3.5 GGUF files (`qwen35`) as llama.cpp's own converter writes them (its convert_hf_to_gguf.py, run in a
subprocess from the folder scripts/setup.sh extracts) from the random qwen3_5 family model, whose 2 key heads
serve 4 value heads (so the converter tiles the value heads): the f32 file, with a multi-token-prediction
head beside the model, gives HF transformers' logprobs on the folder; the Q8_0 file kept in its blocks gives
the bits of the same file dequantized, alone and batched; value heads put back on a quantized tensor's bytes
give the values put back on its dequantization. Qwen3-Next files (`qwen3next`: the same layers over experts
and a shared expert, its b/a projection grouped by key head as HF's) likewise, from the random qwen3_next model;
its shared expert's gate reads the same as the converter's [hidden, 1] or llama-quantize's [hidden].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_logprobs, load_hf
from test_gguf_families import numbers

from coreserve import LLM, SamplingParams
from coreserve.protocol.gguf_header import read_gguf_header
from coreserve.worker.models import gguf_weights
from coreserve.worker.models.gguf_recurrent import TiledHeads
from coreserve.worker.models.loader import read_config
from coreserve.worker.models.quantized import QuantLinear

CONVERTER = Path.home() / ".cache" / "coreserve" / "llama.cpp-convert-0.3.36"
CONVERTED = Path.home() / ".cache" / "coreserve" / "converted-gguf"  # convert()'s files, by their input's digest
# fp32 on both sides, in bf16 mode too (the converter and HF widen the bf16 folder's values alike)
TOLERANCE = 1e-4
# Qwen3-Next's 40-token prompt: HF's chunked forward and its own token-by-token recurrence differ by 8.9e-5
# there; coreserve is within 2.8e-5 of the latter and 1.17e-4 of the former (the folder's run too), 1.89e-4
# on the bf16 folder's values
NEXT_TOLERANCE = 2.5e-4
PROMPTS = [[(7 * i + 3 * j) % 20000 + 100 for j in range(n)] for i, n in enumerate((5, 23, 40))]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=3),
    SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=3),
]
needs_converter = pytest.mark.skipif(
    not (CONVERTER / "convert_hf_to_gguf.py").exists(),
    reason=f"llama.cpp's converter is not at {CONVERTER} (scripts/setup.sh --test extracts it)",
)


def _with_draft_head(source: Path, folder: Path) -> Path:
    """`source` plus a multi-token-prediction head (`mtp.*`, as a hub folder has; HF's model ignores it)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    tensors = load_file(str(source / "model.safetensors"))
    head = {n.replace("model.layers.1.", "mtp.layers.0."): t.clone() for n, t in tensors.items() if ".layers.1." in n}
    width = config["hidden_size"]
    noise = torch.randn(width, 2 * width, generator=torch.Generator().manual_seed(1))
    head |= {"mtp.fc.weight": noise, **{f"mtp.{n}.weight": torch.zeros(width) for n in
             ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")}}
    save_file({**tensors, **head}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def converted(family_model, tmp_path_factory) -> dict[str, str]:
    """{"f32": the draft-headed folder's f32 file, "q8_0": the plain folder's Q8_0 file (--no-mtp)}, both
    written by llama.cpp's converter at once."""
    source = Path(family_model("qwen3_5"))
    out = tmp_path_factory.mktemp("qwen35-gguf")
    jobs = {"f32": (_with_draft_head(source, out / "with-head"), []), "q8_0": (source, ["--no-mtp"])}
    return convert(jobs, out)


def convert(jobs: dict[str, tuple[Path, list[str]]], out: Path) -> dict[str, str]:
    """{outtype: (folder, extra flags)} -> {outtype: its file}, llama.cpp's converter run on every job at once;
    each file kept under CONVERTED by a digest of everything the converter reads (the folder's bytes, the
    flags, the converter's version), so a later session reuses what the converter wrote for the same input."""
    env = dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"), HF_HUB_OFFLINE="1")
    files = {kind: CONVERTED / f"{_digest(folder, [kind, *flags])}.gguf" for kind, (folder, flags) in jobs.items()}
    procs = {
        kind: subprocess.Popen(
            [sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(folder), "--outtype", kind,
             "--outfile", str(out / f"{kind}.gguf"), *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for kind, (folder, flags) in jobs.items() if not files[kind].exists()
    }
    for kind, proc in procs.items():
        log = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, f"llama.cpp's converter failed ({kind}):\n{log[-3000:]}"
        CONVERTED.mkdir(parents=True, exist_ok=True)
        partial = files[kind].with_suffix(f".{os.getpid()}.part")
        shutil.copyfile(out / f"{kind}.gguf", partial)
        os.replace(partial, files[kind])  # whole or not at all
    return {kind: str(path) for kind, path in files.items()}


def _digest(folder: Path, flags: list[str]) -> str:
    """sha256 of the converter's version, `flags` and every file of `folder` (links followed), by name."""
    digest = hashlib.sha256(f"{CONVERTER.name}\0{flags}".encode())
    for item in sorted(folder.iterdir()):
        digest.update(item.name.encode() + b"\0" + item.read_bytes())
    return digest.hexdigest()[:32]


def run(path: str, dtype: str, kept: list | None = None, alone: bool = True) -> tuple[list, list]:
    """(the prompts batched in 16-token chunks, each prompt alone (`alone`; else [])), numbers and all."""
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    params = [PARAMS[i % 2] for i in range(len(PROMPTS))]
    with LLM(path, multiprocess=False, dtype=dtype, max_num_batched_tokens=16) as llm:
        if kept is not None:
            kept.extend(n for n, m in llm.client.core.executor.model.named_modules() if isinstance(m, QuantLinear))
        batched = llm.generate(prompts, params, use_tqdm=False)
        each = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)] if alone else []
    return batched, each


@needs_converter
def test_f32_gguf_with_a_draft_head_gives_hfs_logprobs(converted, family_model):
    """Prompt and sample logprobs of the f32 file within 1e-4 of HF's forward on the folder
    (the converter's fp32 values: its 1 + weight norms, -exp(A_log) and tiled heads read back); the
    draft head's block is in the file but not the model's."""
    path = converted["f32"]
    assert read_config(path)["num_hidden_layers"] == 2
    assert "blk.2.nextn.eh_proj.weight" in {t.name for t in read_gguf_header(path).tensors}
    outputs, _ = run(path, "float32", alone=False)
    assert_gives_hfs_logprobs(outputs, load_hf(family_model("qwen3_5")))


def assert_gives_hfs_logprobs(outputs: list, hf, tolerance: float = TOLERANCE) -> None:
    """Each prompt's prompt and sample logprobs within `tolerance` of HF's forward on its tokens; greedy
    samples HF's argmax."""
    for i, (ids, output) in enumerate(zip(PROMPTS, outputs)):
        completion = output.outputs[0]
        reference = hf_logprobs(hf, ids + completion.token_ids[:-1])
        for position, entries in enumerate(output.prompt_logprobs[1:], start=1):
            for token_id, logprob in entries.items():
                assert abs(logprob.logprob - reference[position - 1, token_id].item()) < tolerance
        for step, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(ids) - 1 + step]
            assert token_id in entries
            if PARAMS[i % 2].temperature == 0:  # greedy: HF's argmax
                assert row[token_id] >= row.max() - tolerance
            for entry_id, logprob in entries.items():
                assert abs(logprob.logprob - row[entry_id].item()) < tolerance


@needs_converter
def test_q8_0_gguf_kept_in_blocks_gives_its_dequantizations_bits(converted):
    """dtype "auto" (the Gated DeltaNet's fused in_proj in its Q8_0 blocks, value-head rows moved as
    bytes) against dtype "float32" on the same file: the same numbers, batched and alone."""
    kept = assert_blocks_give_fp32s_bits(converted["q8_0"], {"layers.0.linear_attn.in_proj", "layers.1.qkv_proj"})
    assert "layers.0.linear_attn.out_proj" not in kept  # 16-wide value heads: its columns move within blocks


def assert_blocks_give_fp32s_bits(path: str, modules: set[str]) -> set[str]:
    """The file kept in its blocks (dtype "auto", `modules` among the kept) gives dtype "float32"'s numbers
    on the same file, batched and alone; returns the kept modules."""
    kept: list[str] = []
    batched, alone = run(path, "auto", kept)
    assert modules <= set(kept)
    fp32_batched, fp32_alone = run(path, "float32")
    assert numbers(batched) == numbers(fp32_batched) and numbers(alone) == numbers(fp32_alone)
    return set(kept)


@pytest.fixture(scope="module")
def converted_next(family_model, tmp_path_factory) -> dict[str, str]:
    """The qwen3_next folder's f32 and Q8_0 files (--no-mtp: the converter wants a draft head otherwise)."""
    source = Path(family_model("qwen3_next"))
    return convert({kind: (source, ["--no-mtp"]) for kind in ("f32", "q8_0")}, tmp_path_factory.mktemp("qwen3next"))


@needs_converter
def test_qwen3_next_gguf_gives_hfs_logprobs_and_its_blocks_their_dequantizations_bits(converted_next, family_model):
    """The f32 file within NEXT_TOLERANCE of HF's forward on the folder (grouped ssm_ba rows put back, the shared
    expert and its gate read); the Q8_0 file kept in its blocks (in_proj's rows moved as bytes) gives the
    same file's float32 numbers."""
    outputs, _ = run(converted_next["f32"], "float32", alone=False)
    assert_gives_hfs_logprobs(outputs, load_hf(family_model("qwen3_next")), NEXT_TOLERANCE)
    assert_blocks_give_fp32s_bits(converted_next["q8_0"], {"layers.0.linear_attn.in_proj",
                                                           "layers.0.moe.shared_expert.gate_up_proj"})


@needs_converter
def test_a_shared_expert_gate_stored_as_a_vector_reads_as_the_converters(converted_next, tmp_path):
    """llama-quantize rewrites ffn_gate_inp_shexp's dims [hidden, 1] as [hidden] (ggml counts no trailing 1):
    both read as HF's [1, hidden], the same values."""
    from untrusted_fuzz_gguf_layout import assemble, encode_entries, encode_tensor, read_layout

    layout = read_layout.__wrapped__(converted_next["q8_0"])  # not kept in read_layout's cache
    is_gate = lambda name: name.endswith("ffn_gate_inp_shexp.weight")  # noqa: E731
    infos = [dataclasses.replace(t, dims=t.dims[:1]) if is_gate(t.name) else t for t in layout.tensors]
    path = tmp_path / "vector-gate.gguf"
    path.write_bytes(assemble(encode_entries(list(layout.entries)), [encode_tensor(i) for i in infos], layout.data))
    as_written, as_vector = ({e.name: e for e in gguf_weights.list_tensors(p)} for p in (converted_next["q8_0"], str(path)))
    gate = "model.layers.0.mlp.shared_expert_gate.weight"
    assert as_written[gate].shape == as_vector[gate].shape == (1, 64)
    assert torch.equal(gguf_weights.read_tensor(as_written[gate]), gguf_weights.read_tensor(as_vector[gate]))


def test_value_heads_moved_as_bytes_are_the_values_moved():
    """out_proj's columns (value heads of 32, whole Q8_0 blocks) put back on the raw blocks, then
    dequantized, equal the dequantized values put back; a head that splits a block has no byte order."""
    from gguf import GGMLQuantizationType, quants

    order = TiledHeads(dim=1, start=0, num_key_heads=2, num_per_key=3, head_size=32)
    values = np.random.default_rng(0).standard_normal((5, 6 * 32)).astype(np.float32)
    raw = torch.from_numpy(quants.quantize(values, GGMLQuantizationType.Q8_0))
    in_bytes = order.in_bytes(GGMLQuantizationType.Q8_0)
    moved = quants.dequantize(in_bytes.undo(raw, "out_proj").numpy(), GGMLQuantizationType.Q8_0)
    dequantized = torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType.Q8_0))
    assert np.array_equal(moved, order.undo(dequantized, "out_proj").numpy())
    # HF's head 3k + v (key head k's value head v) is the file's 2v + k: v0 of each key head, then v1, v2
    file_heads = [2 * v + k for k in range(2) for v in range(3)]
    assert torch.equal(order.undo(torch.arange(6 * 32)[None], "x")[0, ::32], 32 * torch.tensor(file_heads))
    assert TiledHeads(1, 0, 2, 2, 16).in_bytes(GGMLQuantizationType.Q8_0) is None
