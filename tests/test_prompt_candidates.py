"""Prompt scoring (docs/rl.md, "Scoring"): `prompt_logprob_token_ids`, candidate ids scored at each prompt
position, and `prompt_logprobs_temperature`, the scored distribution at logits / T. On the real SmolLM2
(one in-process engine for the module) against Hugging Face's forward of the same file, and against the
engine's own top-k and full-vocabulary rows; bad requests fail alone while the engine keeps serving.
"""

from __future__ import annotations

import pytest
import torch
from conftest import IS_BF16_MODE, TEST_DTYPE
from hf_reference import gguf_reference_folder, one_torch_thread

from coreserve import LLM, SamplingParams
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.protocol.sampling_params import MAX_PROMPT_CANDIDATES

TEXT = "The capital of France is Paris, and the capital of Italy is Rome."
CANDIDATES = [11, 314, 1743, 30, 7]  # fixed ids: some in a position's top-k, most far below it
# |logprob| against HF in fp32 (tests/test_real_model.py's bound); bf16 mode rounds activations
TOLERANCE = 0.25 if IS_BF16_MODE else 1e-4


@pytest.fixture(scope="module")
def smollm2() -> str:
    return builtin_model_path("smollm2")


@pytest.fixture(scope="module")
def llm(smollm2):
    engine = LLM(smollm2, multiprocess=False, dtype=TEST_DTYPE, max_logprobs=-1, num_threads=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    return llm.get_tokenizer().encode(TEXT)


@pytest.fixture(scope="module")
def hf_logits(smollm2, prompt) -> torch.Tensor:
    """[P, V] float32 logits of HF's model of the same GGUF file (transformers' loader, dequantized)."""
    from transformers import AutoModelForCausalLM

    with one_torch_thread():
        model = AutoModelForCausalLM.from_pretrained(gguf_reference_folder(smollm2), dtype=torch.float32)
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].float()


def score(llm: LLM, prompt: list[int], **fields) -> list:
    params = SamplingParams(max_tokens=1, temperature=0.0, **fields)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].prompt_logprobs


def test_candidates_have_the_bits_of_the_same_tokens_in_the_top_k(llm, prompt):
    top = score(llm, prompt, prompt_logprobs=50)
    scored = score(llm, prompt, prompt_logprobs=2, prompt_logprob_token_ids=CANDIDATES)
    assert scored[0] is None and len(scored) == len(prompt)
    num_compared = 0
    for position in range(1, len(prompt)):
        entry = scored[position]
        assert set(CANDIDATES) <= set(entry)  # every candidate at every position, whatever its rank
        assert entry[prompt[position]] == top[position][prompt[position]]  # column 0 unchanged
        for token_id in CANDIDATES:
            if token_id in top[position]:  # the same token from a top-50 row: the same bits and rank
                assert entry[token_id] == top[position][token_id]
                num_compared += 1
    assert num_compared >= 3  # the comparison above is not vacuous


def test_candidates_equal_the_full_vocabulary_and_hf(llm, prompt, hf_logits):
    full = score(llm, prompt, prompt_logprobs=-1)
    scored = score(llm, prompt, prompt_logprob_token_ids=CANDIDATES)
    hf = torch.log_softmax(hf_logits, dim=-1)
    for position in range(1, len(prompt)):
        row = torch.tensor([entry.logprob for entry in full[position].values()])
        for token_id in CANDIDATES:
            got, expected = scored[position][token_id], full[position][token_id]
            # the full-vocabulary row is another computation (log_softmax, not the kernel's pass): its
            # last bits may differ, and with them the order of the near ties within that difference
            gap = abs(got.logprob - expected.logprob)
            near_ties = int(((row - expected.logprob).abs() <= 2 * gap + 1e-6).sum()) - 1
            assert abs(got.rank - expected.rank) <= max(2, near_ties), (got, expected, near_ties)
            assert gap <= TOLERANCE
            assert abs(got.logprob - hf[position - 1, token_id].item()) <= TOLERANCE
        assert len(scored[position]) <= 1 + len(CANDIDATES)  # prompt_logprobs=0 implied: no top-k


def test_one_candidate_row_per_position(llm, prompt):
    rows = [[prompt[i], (prompt[i] + 1 + i) % 1000] for i in range(1, len(prompt))]
    scored = score(llm, prompt, prompt_logprob_token_ids=rows)
    broadcast = score(llm, prompt, prompt_logprob_token_ids=[7, 11])
    for position in range(1, len(prompt)):
        row = rows[position - 1]
        assert set(scored[position]) == set(row)  # the prompt token is the row's first candidate
        assert scored[position][prompt[position]] == broadcast[position][prompt[position]]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_prompt_logprobs_at_a_temperature_are_hfs_log_softmax_of_logits_over_t(
    llm, prompt, hf_logits, temperature
):
    scored = score(
        llm,
        prompt,
        prompt_logprobs=5,
        prompt_logprobs_temperature=temperature,
        prompt_logprob_token_ids=CANDIDATES,
    )
    hf = torch.log_softmax(hf_logits / temperature, dim=-1)
    raw = score(llm, prompt, prompt_logprobs=0)
    tolerance = TOLERANCE * max(1.0, 1.0 / temperature)  # a logit's error is divided by T too
    for position in range(1, len(prompt)):
        for token_id, lp in scored[position].items():
            assert abs(lp.logprob - hf[position - 1, token_id].item()) <= tolerance, (position, token_id)
        token_id = prompt[position]
        if abs(raw[position][token_id].logprob) > 0.5:  # a temperature changes what it scores
            assert abs(scored[position][token_id].logprob - raw[position][token_id].logprob) > 1e-3


def test_default_prompt_logprobs_stay_raw_whatever_the_sampling_temperature(llm, prompt, hf_logits):
    scored = score(llm, prompt, prompt_logprobs=1)
    hot = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=1, temperature=3.0, seed=1, prompt_logprobs=1),
        use_tqdm=False,
    )[0].prompt_logprobs
    hf = torch.log_softmax(hf_logits, dim=-1)
    for position in range(1, len(prompt)):
        assert hot[position] == scored[position]
        token_id = prompt[position]
        assert abs(scored[position][token_id].logprob - hf[position - 1, token_id].item()) <= TOLERANCE


def test_bad_candidates_fail_alone_and_the_engine_keeps_serving(llm, prompt):
    vocab_size = llm.get_tokenizer().vocab_size
    bad = [
        ({"prompt_logprob_token_ids": [vocab_size + 5]}, "out of vocabulary"),
        ({"prompt_logprob_token_ids": [[1], [2]]}, "rows"),
        ({"prompt_logprob_token_ids": [[1, 2]] + [[3]] * (len(prompt) - 2)}, "same number"),
    ]
    for fields, words in bad:
        with pytest.raises(ValueError, match=words):
            score(llm, prompt, **fields)
    assert score(llm, prompt, prompt_logprob_token_ids=[5])[1][5].rank >= 1


def test_sampling_params_refuse_what_they_cannot_score():
    with pytest.raises(ValueError, match="MAX_PROMPT_CANDIDATES"):
        SamplingParams(prompt_logprob_token_ids=list(range(MAX_PROMPT_CANDIDATES + 1)))
    with pytest.raises(ValueError, match="distinct"):
        SamplingParams(prompt_logprob_token_ids=[3, 3])
    with pytest.raises(ValueError, match="prompt_logprobs_temperature needs prompt_logprobs"):
        SamplingParams(prompt_logprobs_temperature=0.7)
    with pytest.raises(ValueError, match="prompt_logprobs_temperature"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_temperature=0.0)
    params = SamplingParams(prompt_logprob_token_ids=[4, 9])
    assert params.prompt_logprob_token_ids == [[4, 9]] and params.prompt_logprobs == 0
