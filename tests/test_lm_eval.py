"""lm-eval (the test extras' `lm-eval[api]`) scores 16 of the suite's 48 multiple-choice questions
(tests/data/smollm2_mc.jsonl, four of each kind: capitals, arithmetic, colours, quoted opposites) as a
local task on the real SmolLM2, two ways, and every choice's log-likelihood equals HF's on the same token
ids within 1e-4 (fp32):
- against coreserve's server with no local tokenizer: its `local-completions` model with
  `tokenizer_backend=remote`, which reads `/tokenizer_info`, tokenizes with `/tokenize` and decodes with
  `/detokenize` (lm_eval/utils.py's RemoteTokenizer);
- in process, its `vllm` model (lm_eval/models/vllm_causallms.py) on coreserve's `LLM` through
  coreserve/frontend/vllm_shim.py, no vLLM installed: `python -m coreserve.frontend.vllm_shim -m lm_eval --model vllm`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import IS_BF16_MODE
from hf_reference import gguf_reference, gguf_reference_folder
from server_harness import running_server

from coreserve.frontend.engine.engine_args import load_tokenizer
from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder
from coreserve.protocol.builtin_model import builtin_model_path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from eval_lm_eval import DATA, TASK  # noqa: E402

TOLERANCE = 4 * 0.25 if IS_BF16_MODE else 1e-4  # a sum of 1-4 tokens (test_real_model.py's bound)
# lm-eval's --samples: the questions scored, four of each kind (the whole set took 3 times as long)
QUESTIONS = [0, 5, 9, 11, 12, 14, 17, 23, 24, 27, 32, 35, 36, 41, 45, 47]


def test_local_completions_with_the_remote_tokenizer_gets_hfs_loglikelihoods(tmp_path):
    path = builtin_model_path("smollm2")
    flags = ("--served-model-name", "coreserve", "--dtype", "bfloat16" if IS_BF16_MODE else "auto")
    with running_server(*flags, model=path) as (base, _):
        command = [
            sys.executable, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"model=coreserve,base_url={base}/v1/completions,tokenizer_backend=remote,"
            "num_concurrent=2,max_retries=1",
        ]
        _run_lm_eval(command, tmp_path)
    _assert_hf_scores(tmp_path, path)


def test_the_vllm_backend_on_coreserves_llm_gets_hfs_loglikelihoods(tmp_path):
    """lm-eval's in-process vLLM backend with the shim's `vllm`: a folder model (lm-eval reads its
    config with AutoConfig), SmolLM2's weights as HF dequantizes them and the GGUF's tokenizer."""
    path = builtin_model_path("smollm2")
    folder = tmp_path / "smollm2"
    shutil.copytree(gguf_tokenizer_folder(path), folder)
    reference = Path(gguf_reference_folder(path))
    (folder / "model.safetensors").symlink_to(reference / "model.safetensors")
    config = json.loads((reference / "config.json").read_text())  # transformers' GGUF load names no class
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    dtype = "bfloat16" if IS_BF16_MODE else "float32"
    command = [
        sys.executable, "-m", "coreserve.frontend.vllm_shim", "-m", "lm_eval", "--model", "vllm",
        "--model_args", f"pretrained={folder},dtype={dtype},max_model_len=2048,num_threads=2",
        "--batch_size", "auto",
    ]
    _run_lm_eval(command, tmp_path)
    _assert_hf_scores(tmp_path, path)


def _run_lm_eval(command: list[str], tmp_path) -> None:
    (tmp_path / "tasks").mkdir(exist_ok=True)
    (tmp_path / "tasks" / "coreserve_smollm2_mc.yaml").write_text(TASK.format(data=DATA))
    command += [
        "--tasks", "coreserve_smollm2_mc", "--include_path", str(tmp_path / "tasks"),
        "--output_path", str(tmp_path / "out"), "--log_samples",
        "--samples", json.dumps({"coreserve_smollm2_mc": QUESTIONS}),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    subprocess.run(command, check=True, cwd=tmp_path, env=env, timeout=600, stdout=subprocess.DEVNULL)


def _assert_hf_scores(tmp_path, path: str) -> None:
    """Each choice's log-likelihood in lm-eval's samples equals HF's on lm-eval's own token ids."""
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    assert sorted(sample["doc_id"] for sample in samples) == QUESTIONS
    tokenizer = load_tokenizer(path)
    sequences, wanted, scores = [], [], []
    for sample in samples:  # lm-eval's own requests: context and continuation, tokenized apart (no specials)
        requests = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]  # gen_args_0, 1, ...
        for (context, continuation), response in zip(requests, sample["filtered_resps"]):
            context_ids = tokenizer(context, add_special_tokens=False).input_ids
            ids = context_ids + tokenizer(continuation, add_special_tokens=False).input_ids
            sequences.append(ids)
            wanted.append({r: [ids[r + 1]] for r in range(len(context_ids) - 1, len(ids) - 1)})
            scores.append(float(response[0]))
    answers = gguf_reference(path).teacher_forced(sequences, wanted)
    theirs = [sum(rows[r].logprobs[ids[r + 1]] for r in rows) for rows, ids in zip(answers, sequences)]
    worst = max(abs(a - b) for a, b in zip(scores, theirs))
    assert worst <= TOLERANCE, worst
