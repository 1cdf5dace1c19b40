"""coreserve/frontend/vllm_shim.py: vLLM's module names over coreserve, in a fresh interpreter (the shim changes
sys.modules): the names a vLLM program imports, its version, the engine arguments lm-eval passes taken at
their defaults and refused by name otherwise; the same outputs as coreserve's own LLM."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = r"""
import importlib.metadata, importlib.util, sys
import coreserve.frontend.vllm_shim as shim
shim.install()
shim.install()  # twice: nothing changes
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.tokenizers import get_tokenizer
from vllm.renderers.hf import resolve_chat_template
from coreserve import LLM as CoreserveLLM
assert importlib.metadata.version("vllm") == shim.VLLM_API_VERSION
assert importlib.util.find_spec("vllm") is not None
model = sys.argv[1]
lm_evals = dict(revision=None, tokenizer=None, tokenizer_mode="auto", tokenizer_revision=None,
                trust_remote_code=False, max_model_len=None, max_num_seqs=None, quantization=None,
                seed=1234, enable_lora=False, max_lora_rank=16, tensor_parallel_size=1, dtype="float32")
params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=[464, 3139, 286, 4881, 318])]
with LLM(model, multiprocess=False, **lm_evals) as llm:
    assert llm.llm_engine.model_config.max_model_len == llm.facts.max_model_len
    got = llm.generate(prompts, sampling_params=[params], use_tqdm=False, lora_request=None)
    for call, words in [(lambda: llm.generate(prompts, params, lora_request=object()), "lora_request"),
                        (lambda: llm.generate(prompts, params, lora_request=LoRARequest("x", 1, "/tmp")),
                         "enable_lora")]:
        try:
            call()
        except ValueError as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(words)
with CoreserveLLM(model, multiprocess=False, dtype="float32") as llm:
    expected = llm.generate(prompts, params, use_tqdm=False)
assert got[0].prompt_logprobs == expected[0].prompt_logprobs and got[0].outputs[0].text == ""
for name, value in [("revision", "main"), ("trust_remote_code", True), ("tokenizer", "other"),
                    ("quantization", "awq")]:
    try:
        LLM(model, multiprocess=False, **{name: value})
    except ValueError as exc:
        assert name in str(exc), exc
    else:
        raise AssertionError(name)
assert get_tokenizer(model)("hello").input_ids
assert resolve_chat_template(tokenizer=None, chat_template="{{ x }}") == "{{ x }}"
print("ok")
"""


def test_vllms_names_run_coreserve_and_refuse_what_it_does_not_build(tiny_path):
    done = subprocess.run([sys.executable, "-c", PROGRAM, tiny_path], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_shim_refuses_to_shadow_a_real_vllm(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    program = "import coreserve.frontend.vllm_shim as s\ntry:\n    s.install()\nexcept RuntimeError as e:\n    print(e)\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert "a real vllm is importable here" in done.stdout, done.stderr[-2000:]
