"""Real tokenizers (Llama 3 byte-level BPE, Llama 2 SentencePiece with byte fallback): output text equals
`tokenizer.decode`, streamed or not, at O(new tokens) per step; decoded_token stays byte-exact; padded
ids have no text (coreserve/frontend/engine/token_text.py through the engine)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from real_tokenizers import real_tokenizer_path

from coreserve import LLM, AsyncLLM, SamplingParams
from coreserve.frontend.engine.token_text import IncrementalDetokenizer, TokenTable

TOKENIZER_FAMILIES = {"llama3": "llama3.1", "llama2": "llama2"}  # tokenizer -> a test model that uses it
PROMPTS = [
    "Crème brûlée, naïve café, Ångström — señor Müller's façade",
    "日本語と中文的文本，한국어 텍스트도",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "def f(x):\n\treturn {'a': [x ** 2 for _ in range(3)]}  # code",
    "I can't, you won't, we'd've, they're, it's y'all's",
]


@pytest.fixture(scope="module", params=list(TOKENIZER_FAMILIES))
def tokenizer_case(request, family_model):
    from transformers import AutoTokenizer

    name = request.param
    return (
        name,
        AutoTokenizer.from_pretrained(real_tokenizer_path(name)),
        family_model(TOKENIZER_FAMILIES[name]),
    )


def test_sampled_text_equals_tokenizer_decode_streamed_or_not(tokenizer_case):
    name, tokenizer, path = tokenizer_case
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, skip_special_tokens=True)
    with LLM(path, multiprocess=False) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert (
            output.prompt_token_ids == tokenizer(prompt).input_ids
        )  # the BOS once, as the tokenizer adds it
        assert output.prompt_token_ids.count(tokenizer.bos_token_id) == 1
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True), name

    async def stream(engine) -> list[str]:
        texts = []
        for i, prompt in enumerate(PROMPTS):
            deltas = [out.outputs[0].text async for out in engine.generate(prompt, params, f"s{i}")]
            texts.append("".join(deltas))
        return texts

    with AsyncLLM(path, multiprocess=False) as engine:
        streamed = asyncio.run(stream(engine))
    assert streamed == [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("skip_special_tokens, spaces_between", [(True, True), (False, True), (False, False)])
def test_detokenizer_equals_decode_over_random_ids(tokenizer_case, skip_special_tokens, spaces_between):
    """Random ids: byte-fallback runs, special tokens and padded ids (past the tokenizer) mixed in."""
    _, tokenizer, _ = tokenizer_case
    table, rng = TokenTable(tokenizer), np.random.default_rng(0)
    pool = sorted(table.byte_token_ids | table.special_ids) + [len(tokenizer) + 5]
    for _ in range(60):
        ids = [
            int(rng.choice(pool)) if rng.random() < 0.3 else int(rng.integers(len(tokenizer)))
            for _ in range(50)
        ]
        detokenizer = IncrementalDetokenizer(table, skip_special_tokens, spaces_between)
        pieces = [detokenizer.append(ids[i : i + 2]) for i in range(0, len(ids), 2)] + [detokenizer.flush()]
        expected = tokenizer.decode(
            [t for t in ids if t < len(tokenizer)],
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between,
        )
        assert "".join(pieces) == expected


def test_decode_cost_per_token_does_not_grow_with_the_output(tokenizer_case):
    """Over a 2,000-token output the tokenizer is only ever asked for a few tokens at a time (none at all
    for byte-level BPE), so a step costs the same at token 2,000 as at token 10."""
    _, tokenizer, _ = tokenizer_case
    calls: list[int] = []

    class CountingTokenizer:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __len__(self) -> int:
            return len(self.inner)

        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return self.inner.decode(ids, **kwargs)

    table = TokenTable(tokenizer)
    table.tokenizer = CountingTokenizer(tokenizer)
    ids = np.random.default_rng(1).integers(0, len(tokenizer), 2000).tolist()
    calls.clear()
    detokenizer = IncrementalDetokenizer(table, skip_special_tokens=True)
    text = "".join(detokenizer.append([t]) for t in ids) + detokenizer.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    if table.is_byte_level:
        assert calls == []
    else:
        assert len(calls) <= 2 * len(ids) and max(calls) <= 12


def test_decoded_tokens_are_byte_exact(tokenizer_case):
    _, tokenizer, _ = tokenizer_case
    table = TokenTable(tokenizer)
    assert table.token_bytes is not None
    for token_id in list(table.byte_token_ids)[:256:17]:  # <0xNN>: the byte itself, recoverable
        assert table.decode_token(token_id).encode("utf-8", "surrogateescape") == table.token_bytes[token_id]
    texts = [table.decode_token(i) for i in range(len(tokenizer))]
    assert len(set(texts)) > 0.99 * len(texts)
    hello = tokenizer.encode(" Hello", add_special_tokens=False)[-1]
    assert table.decode_token(hello).strip() == "Hello"
    assert table.decode_token(len(tokenizer)) == ""  # a padded id: no text


def test_padded_vocabulary_ids_detokenize_to_empty_text(family_model):
    """Qwen-style: the embedding (config vocab_size) is larger than the tokenizer; an id past it in the
    prompt is accepted and its logprob entries carry an empty decoded_token, never a crash."""
    path = family_model("qwen2")
    with LLM(path, multiprocess=False) as llm:
        num_tokens = len(llm.get_tokenizer())
        padded_id = num_tokens + 7
        params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
        (output,) = llm.generate([[128000, 791, padded_id, 1317]], params, use_tqdm=False)
    entry = output.prompt_logprobs[2][padded_id]
    assert entry.decoded_token == ""
    assert output.outputs[0].text == llm.get_tokenizer().decode(
        output.outputs[0].token_ids, skip_special_tokens=True
    )
