"""Streaming as vLLM's own tests expect it (issue 20), through the official openai client: with n > 1 a
finished choice is sent once and never after (completions and chat); stream_options only with a stream,
include_usage and continuous_usage_stats; usage.prompt_tokens_details.cached_tokens from the prefix
cache with --enable-prompt-tokens-details (null without it, as vLLM)."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import PROMPTS
from server_harness import MODEL, chat_template_file, running_server

# Sampled (seeded) completions that each end at their first "a", after different numbers of tokens
# (asserted): they finish at different steps, the case where finished choices were sent again.
STAGGERED = dict(n=3, temperature=1.0, seed=5, max_tokens=24, stop=["a"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--chat-template", chat_template_file(tmp_path_factory), "--num-kv-blocks", "256"]
    flags.append("--enable-prompt-tokens-details")
    with running_server(*flags) as (base, _):
        yield base


def assert_each_choice_finishes_once(chunks) -> None:
    """Every choice index 0..2 gets one chunk with a finish_reason and no chunk after it."""
    finished_at: dict[int, int] = {}
    for number, chunk in enumerate(chunks):
        for choice in chunk.choices:
            assert choice.index not in finished_at, f"choice {choice.index} sent again after its finish"
            if choice.finish_reason is not None:
                finished_at[choice.index] = number
    assert sorted(finished_at) == [0, 1, 2]


def test_completions_stream_with_n_sends_each_finished_choice_once(client):
    request = dict(model=MODEL, prompt=PROMPTS[0], **STAGGERED)
    whole = client.completions.create(**request, logprobs=0)
    assert len({len(c.logprobs.tokens) for c in whole.choices}) == 3  # staggered finishes
    chunks = list(client.completions.create(**request, stream=True))
    assert_each_choice_finishes_once(chunks)
    for choice in whole.choices:
        streamed = [c for chunk in chunks for c in chunk.choices if c.index == choice.index]
        assert "".join(c.text for c in streamed) == choice.text
        assert streamed[-1].finish_reason == choice.finish_reason


def test_chat_stream_with_n_sends_each_finished_choice_once(client):
    """And, with return_token_ids, each choice's first chunk carries the prompt's ids (as vLLM's) and the
    chunks' token_ids add up to the choice's."""
    messages = [{"role": "user", "content": "Say something."}]
    request = dict(model=MODEL, messages=messages, **STAGGERED, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**request, logprobs=True)
    assert len({len(c.logprobs.content) for c in whole.choices}) == 3  # staggered finishes
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert_each_choice_finishes_once(chunks)
    firsts = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.role == "assistant"]
    assert [chunk.choices[0].index for chunk in firsts] == [0, 1, 2]
    assert all(chunk.prompt_token_ids == whole.prompt_token_ids for chunk in firsts)
    for choice in whole.choices:
        streamed = [c for chunk in chunks for c in chunk.choices if c.index == choice.index]
        assert "".join(c.delta.content or "" for c in streamed) == choice.message.content
        assert [t for c in streamed for t in c.token_ids] == choice.token_ids


def test_stream_options_without_stream_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            stream_options={"include_usage": True},
        )
    assert info.value.body["param"] == "stream_options"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}

    def streamed() -> list:
        if endpoint == "completions":
            return list(client.completions.create(
                model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True, stream_options=options
            ))
        return list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=6, temperature=0,
            stream=True, stream_options=options,
        ))

    # A loaded host may hand several tokens to one chunk (the server sends what is ready); retried a few
    # times until the tokens came in steps, so the running counts are seen
    for _ in range(5):
        chunks = streamed()
        counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
        if len(set(counts)) > 2:
            break
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) > 2
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert not chunks[-1].choices  # the final usage chunk, as without continuous stats


def test_include_usage_alone_puts_usage_in_the_last_chunk_only(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_cached_tokens_count_the_prompt_tokens_read_from_the_prefix_cache(client):
    prompt = "A prompt that no other test sends, long enough to fill several blocks. " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details is None  # none cached: null, as vLLM
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks of 16
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_prompt_tokens_details_are_null_without_the_flag():
    prompt = "Another prompt no other test sends, long enough to fill several blocks. " * 6
    with running_server("--num-kv-blocks", "64") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # the second reads the prefix cache
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert reply.usage.prompt_tokens_details is None
        hits = [line for line in httpx.get(f"{base}/metrics").text.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total")]
        assert hits and float(hits[0].split()[-1]) > 0  # there were cached tokens to leave out
