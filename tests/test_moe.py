"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE, Qwen3-Next, gpt-oss) on random weights: the routed experts a request
gets back equal Hugging Face's router top-k on the same tokens; a request's tokens, logprobs and
experts are the same bits alone, in a batch, chunked, preempted, in multi-step windows and under
tensor parallelism; scoring a generated sequence gives its sample logprobs. Numbers against HF's are
test_model_families.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_hf
from test_batch_invariance import sampled_rows
from test_model_families import FAMILY_PROMPTS

from coreserve import LLM, SamplingParams
from coreserve.frontend.errors import RequestFailedError

# Qwen3-Next: a hybrid, with a shared expert; gpt-oss: its router's top-k logits (then their softmax), a bias
MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "gpt_oss"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5, return_routed_experts=True)
SAMPLED = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=5, return_routed_experts=True)


def hf_router_top_k(model, token_ids: list[int], top_k: int) -> np.ndarray:
    """[positions, MoE layers, top_k]: HF's router logits (output_router_logits), softmax, top-k ids."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    layers = [torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices for logits in out.router_logits]
    return torch.stack(layers, dim=1).numpy()


def routed(output) -> np.ndarray:
    return output.outputs[0].routed_experts


@pytest.mark.fp32_exact("bf16 routing flips near-ties against fp32 HF (docs/models.md: the measured bound)")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_experts_equal_hf_router_top_k(family, family_model):
    path = family_model(family)
    with LLM(path, multiprocess=False) as llm:
        outputs = llm.generate(FAMILY_PROMPTS[:4], [GREEDY, SAMPLED] * 2, use_tqdm=False)
        num_layers = llm.facts.num_moe_layers
    hf = load_hf(path)
    top_k = hf.config.num_experts_per_tok
    for output in outputs:
        tokens = output.prompt_token_ids + output.outputs[0].token_ids
        experts = routed(output)
        assert experts.dtype == np.int16 and experts.shape == (len(tokens) - 1, num_layers, top_k)
        assert np.array_equal(experts, hf_router_top_k(hf, tokens[:-1], top_k))


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=16, num_kv_blocks=8, block_size=16),  # chunked and preempted
        dict(num_scheduler_steps=4),  # multi-step windows
    ],
    ids=["chunked-preempted", "multi-step"],
)
def test_routed_experts_and_logprobs_equal_a_plain_run(engine_args, family_model):
    path = family_model("qwen3_moe")
    params = [SAMPLED if i % 2 else GREEDY for i in range(len(FAMILY_PROMPTS))]
    with LLM(path, multiprocess=False) as llm:
        plain = llm.generate(FAMILY_PROMPTS, params, use_tqdm=False)
    with LLM(path, multiprocess=engine_args.get("tensor_parallel_size", 1) > 1, **engine_args) as llm:
        other = llm.generate(FAMILY_PROMPTS, params, use_tqdm=False)
        if "num_kv_blocks" in engine_args:
            assert llm.get_engine_stats().num_preemptions > 0
    for a, b in zip(plain, other):
        assert sampled_rows(a) == sampled_rows(b)
        assert np.array_equal(routed(a), routed(b))


def test_tensor_parallel_splits_each_expert(family_model):
    """Two ranks, each holding half of every expert's columns: TP=1's greedy tokens and routed experts,
    its logprobs within 1e-4 (the sum over ranks adds in another order), as for the dense models."""
    path = family_model("qwen3_moe")
    with LLM(path, multiprocess=False) as llm:
        plain = llm.generate(FAMILY_PROMPTS, GREEDY, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, num_threads=1) as llm:
        split = llm.generate(FAMILY_PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(plain, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert np.array_equal(routed(a), routed(b))
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_routed_experts_are_refused_by_name_on_a_dense_model(tiny_path):
    with LLM(tiny_path, multiprocess=False) as llm:
        with pytest.raises((ValueError, RequestFailedError), match="return_routed_experts"):
            llm.generate(["hello"], SamplingParams(max_tokens=2, return_routed_experts=True), use_tqdm=False)
        assert llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_request_without_the_flag_gets_none_and_reads_the_prefix_cache(family_model):
    with LLM(family_model("mixtral"), multiprocess=False) as llm:
        plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([FAMILY_PROMPTS[0]], plain, use_tqdm=False)
        warm = llm.generate([FAMILY_PROMPTS[0]], plain, use_tqdm=False)[0]
        assert warm.outputs[0].routed_experts is None and warm.num_cached_tokens > 0
        asked = llm.generate([FAMILY_PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert asked.num_cached_tokens == 0  # every position computed: its experts are known
        assert len(routed(asked)) == len(asked.prompt_token_ids) + 11


def test_the_server_returns_routed_experts_on_completions_and_chat(family_model, tmp_path):
    """The official openai client, `return_routed_experts` in extra_body: each choice carries
    [positions][layers][top_k], the Python API's, streamed (in the finishing chunk) or not."""
    import openai
    from server_harness import running_server

    path = family_model("olmoe")
    prompt = FAMILY_PROMPTS[3]
    with LLM(path, multiprocess=False) as llm:
        alone = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        expected = routed(alone).tolist()
    extra = {"ignore_eos": True, "return_routed_experts": True}
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    with running_server("--chat-template", str(template), "--enable-rl-endpoints", model=path) as (base, _):
        _slimes_routing_replay(base, alone.prompt_token_ids, expected)
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
            done = client.completions.create(model=path, prompt=prompt, max_tokens=12, temperature=0.0, extra_body=extra)
            assert done.choices[0].model_extra["routed_experts"] == expected
            chunks = list(client.completions.create(
                model=path, prompt=prompt, max_tokens=12, temperature=0.0, stream=True, extra_body=extra
            ))
            streamed = [c.choices[0].model_extra.get("routed_experts") for c in chunks if c.choices]
            assert [r for r in streamed if r is not None] == [expected]
            chat = client.chat.completions.create(
                model=path, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, extra_body=extra
            )
            experts = chat.choices[0].model_extra["routed_experts"]
            assert len(experts) == chat.usage.prompt_tokens + 4 and len(experts[0]) == 2
            plain = client.completions.create(model=path, prompt=prompt, max_tokens=2)
            assert "routed_experts" not in plain.choices[0].model_extra


def _slimes_routing_replay(base: str, prompt_ids: list[int], expected: list) -> None:
    """SGLang's /generate with return_routed_experts, decoded as slime does (utils/misc.py
    decode_int32_meta_array, reshaped to [len(tokens) - 1, layers, top_k] in utils/types.py)."""
    import base64

    import httpx

    body = {"input_ids": prompt_ids, "return_routed_experts": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    answer = httpx.post(base + "/generate", json=body, timeout=60).json()
    flat = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype=np.int32)
    rows = len(prompt_ids) + len(answer["output_ids"]) - 1
    assert flat.reshape(rows, len(expected[0]), len(expected[0][0])).tolist() == expected


def test_olmoe_under_tensor_parallelism_is_refused_by_name(family_model):
    with pytest.raises(Exception, match="OLMoE"):
        LLM(family_model("olmoe"), tensor_parallel_size=2)
