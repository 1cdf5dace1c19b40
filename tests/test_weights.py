"""Checkpoint weights: sharded bf16 safetensors, dtype="auto" and explicit dtypes against Hugging Face,
and the memory that loading takes (coreserve/worker/models/loader.py, coreserve/worker/models/safetensors_files.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_PROMPTS_SHORT, hf_logprobs, load_hf, write_family_model

from coreserve import LLM, SamplingParams
from coreserve.worker.models.loader import load_model, resolve_dtype

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory) -> str:
    path = write_family_model(
        tmp_path_factory.mktemp("bf16"), "llama2", dtype="bfloat16", max_shard_size="3MB"
    )
    assert len(json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    assert len(list(Path(path).glob("*.safetensors"))) > 2
    return path


def test_auto_dtype_is_the_checkpoints(sharded_bf16):
    model = load_model(sharded_bf16, "auto", torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == torch.float32  # tables stay fp32, cast per step as HF casts them


def test_fp16_checkpoint_runs_in_fp32_on_the_cpu_by_default():
    assert resolve_dtype("auto", "float16", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", "float16", torch.device("cuda")) == torch.float16
    assert resolve_dtype("float16", "bfloat16", torch.device("cpu")) == torch.float16


def test_fp16_checkpoint_loads_exactly_widened_to_fp32_on_the_cpu(tmp_path):
    from safetensors.torch import load_file

    path = write_family_model(tmp_path, "llama2", dtype="float16")
    model = load_model(path, "auto", torch.device("cpu"))
    stored = load_file(str(Path(path) / "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == torch.float16
    assert torch.equal(model.embed_tokens.weight, stored["model.embed_tokens.weight"].float())
    q_rows = model.args.num_heads * model.args.head_dim
    expected_k = stored["model.layers.1.self_attn.k_proj.weight"].float()
    assert torch.equal(model.layers[1].qkv_proj.weight[q_rows : q_rows + expected_k.shape[0]], expected_k)


def test_sharded_bf16_checkpoint_in_fp32_matches_hf_fp32(sharded_bf16):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=2)
    with LLM(sharded_bf16, multiprocess=False, dtype="float32") as llm:
        outputs = llm.generate(FAMILY_PROMPTS_SHORT, params, use_tqdm=False)
    hf = load_hf(sharded_bf16)  # HF upcasts the bf16 weights to fp32 too
    for output in outputs:
        completion = output.outputs[0]
        reference = hf_logprobs(hf, output.prompt_token_ids + completion.token_ids)
        start = len(output.prompt_token_ids) - 1
        for step, entries in enumerate(completion.logprobs):
            row = reference[start + step]
            assert row[completion.token_ids[step]] >= row.max() - TOLERANCE
            for token_id, logprob in entries.items():
                assert abs(logprob.logprob - row[token_id].item()) < TOLERANCE
        for position, entries in enumerate(output.prompt_logprobs[1:], start=1):
            for token_id, logprob in entries.items():
                assert abs(logprob.logprob - reference[position - 1, token_id].item()) < TOLERANCE


def test_bf16_engine_generates_from_the_bf16_checkpoint(sharded_bf16):
    with LLM(sharded_bf16, multiprocess=False) as llm:  # dtype="auto": bf16 weights, the C kernels
        (output,) = llm.generate(FAMILY_PROMPTS_SHORT[0], SamplingParams(temperature=0, max_tokens=4))
    assert len(output.outputs[0].token_ids) == 4


_MEASURE = """
import sys, torch
from pathlib import Path
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.loader import load_model, read_config
def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024
# torch's one-time set-up, not the loader's, before the baseline: building on the meta device, and the
# first CPU allocation of a module (~38 MB, lazily, whatever its size)
with torch.device("meta"):
    DecoderModel(DecoderArgs.from_hf_config(read_config(sys.argv[1])))
torch.nn.Linear(4, 4, device="meta").to_empty(device="cpu")
Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS:")
model = load_model(sys.argv[1], sys.argv[2], torch.device("cpu"))
print(status("VmHWM:") - before, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_loading_peaks_below_1_3x_the_model_size(dtype, tmp_path):
    """A bf16 checkpoint of ~90 MB loaded into fp32 (~180 MB) or bf16: the process grows by at most
    1.3x the model in that dtype (the old loader held an fp32 copy of everything, then the model)."""
    _write_random_checkpoint(tmp_path, hidden=512, layers=4, vocab=32000)
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path), dtype],
        capture_output=True, text=True, cwd=root, check=True, timeout=120,
    )
    grown, model_bytes = map(int, result.stdout.split())
    assert model_bytes > 80e6
    assert grown <= 1.3 * model_bytes, (grown / model_bytes, dtype)


def _write_random_checkpoint(folder: Path, hidden: int, layers: int, vocab: int) -> None:
    """A Llama checkpoint in two bf16 shards, written with torch alone (no HF model in memory)."""
    from safetensors.torch import save_file

    inter, weight_map = 3 * hidden, {}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[prefix + f"self_attn.{name}.weight"] = (hidden, hidden)
        for name, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            shapes[prefix + f"mlp.{name}.weight"] = shape
        shapes[prefix + "input_layernorm.weight"] = shapes[prefix + "post_attention_layernorm.weight"] = (
            hidden,
        )
    names = list(shapes)
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-0000{shard + 1}-of-00002.safetensors"
        save_file({n: torch.randn(shapes[n], dtype=torch.bfloat16) for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                  max_position_embeddings=256, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
