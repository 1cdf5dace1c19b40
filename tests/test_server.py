"""`coreserve serve` end to end: one real server process (spawned core, builtin:tiny) per module, driven
by the official `openai` client and, for raw HTTP cases, httpx. Values are compared with `LLM`'s."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import PROMPTS

from frontend import SamplingParams
from frontend.chat_template import render_chat

API_KEY = "sk-test-coreserve"
MODEL = "builtin:tiny"
MAX_MODEL_LEN = 512
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(*flags: str, startup_timeout_s: float = 180.0):
    """`python -m frontend serve builtin:tiny --port P ...` until it answers /health; yields (base url, process)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "frontend",
        "serve",
        MODEL,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("CORESERVE_API_KEY", None)
    proc = subprocess.Popen([*command, *flags], cwd=REPO, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _is_healthy(base):
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _is_healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    template.write_text(CHATML)
    flags = ["--api-key", API_KEY, "--chat-template", str(template), "--num-kv-blocks", "256"]
    with running_server(*flags, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "128") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        yield http


def text_of(table_text: str) -> str:
    """The JSON text of a token as the server writes it (bytes:\\xNN for a piece of a character)."""
    try:
        table_text.encode("utf-8")
    except UnicodeEncodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in table_text.encode("utf-8", "surrogateescape"))
    return table_text


def legacy_expected(positions, token_ids, k):
    """What legacy completions must say for LLM positions: token texts, logprobs, top-k dicts."""
    tokens, values, tops = [], [], []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        tokens.append(text_of(chosen.decoded_token))
        values.append(chosen.logprob)
        top = {text_of(lp.decoded_token): lp.logprob for lp in position.values() if lp.rank <= k}
        top[text_of(chosen.decoded_token)] = chosen.logprob
        tops.append(top)
    return tokens, values, tops


# ---- completions ------------------------------------------------------------------------------------


def test_completion_logprobs_equal_llm(client, llm_inproc):
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3
    )
    request_output = llm_inproc.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False
    )[0]
    expected = request_output.outputs[0]
    choice = result.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "length"
    tokens, values, tops = legacy_expected(expected.logprobs, expected.token_ids, 3)
    assert choice.logprobs.tokens == tokens
    assert choice.logprobs.token_logprobs == values
    assert choice.logprobs.top_logprobs == tops
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == len(request_output.prompt_token_ids)


def test_echo_with_max_tokens_zero_scores_the_prompt(client, llm_inproc):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=0, echo=True, logprobs=2)
    expected = llm_inproc.generate(
        PROMPTS[2], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    choice = result.choices[0]
    assert choice.text == PROMPTS[2]
    ids = expected.prompt_token_ids
    tokens, values, tops = legacy_expected(expected.prompt_logprobs[1:], ids[1:], 2)
    assert choice.logprobs.tokens[1:] == tokens and choice.logprobs.tokens[0] == text_of("In")
    assert choice.logprobs.token_logprobs == [None, *values]
    assert choice.logprobs.top_logprobs == [None, *tops]
    assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(ids)


def test_echo_one_token_gives_the_same_number_in_token_and_top_logprobs(client):
    """Evaluation harnesses send echo, max_tokens 1, logprobs 1 and look up each token in top_logprobs."""
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[13], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == result.usage.prompt_tokens + 1
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == value


def test_text_offsets_index_the_choice_text(client):
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, echo=True, logprobs=0, temperature=0
    )
    choice = result.choices[0]
    offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for start, end, token in zip(offsets, [*offsets[1:], len(choice.text)], tokens):
        if not token.startswith("bytes:"):
            assert choice.text[start:end] == token


def test_a_token_that_is_part_of_a_character_is_written_as_bytes(client):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=0, echo=True, logprobs=1)
    tokens = result.choices[0].logprobs.tokens
    pieces = [t for t in tokens if t.startswith("bytes:")]
    assert pieces, tokens
    raw = b"".join(
        bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in tokens
    )
    assert raw.decode("utf-8") == PROMPTS[10]


def test_streamed_completion_concatenates_to_the_whole_response(client):
    request = dict(model=MODEL, prompt=PROMPTS[5], max_tokens=12, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**request).choices[0]
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    chunks = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c.logprobs for v in getattr(c.logprobs, field)] == getattr(
            whole.logprobs, field
        )
    assert chunks[-1].finish_reason == "length" and usage.completion_tokens == 12


def test_several_prompts_and_n_give_one_choice_each(client, tokenizer):
    ids = tokenizer(PROMPTS[3]).input_ids
    result = client.completions.create(
        model=MODEL, prompt=[ids, ids], max_tokens=4, n=2, seed=3, temperature=1.0
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 2 * len(ids) and result.usage.completion_tokens == 16
    assert result.choices[0].text == result.choices[2].text  # same prompt, same seed, same completion index


# ---- chat -------------------------------------------------------------------------------------------


def chat_messages():
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]


def test_chat_logprobs_equal_llm_with_exact_bytes(client, llm_inproc, tokenizer):
    result = client.chat.completions.create(
        model=MODEL, messages=chat_messages(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    flat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids = tokenizer(render_chat(tokenizer, flat, CHATML, True), add_special_tokens=False).input_ids
    expected = llm_inproc.generate(
        ids, SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    choice = result.choices[0]
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert result.usage.prompt_tokens == len(ids)
    for entry, token_id, position in zip(choice.logprobs.content, expected.token_ids, expected.logprobs):
        chosen = position[token_id]
        assert entry.logprob == chosen.logprob
        assert bytes(entry.bytes) == chosen.decoded_token.encode("utf-8", "surrogateescape")
        top = sorted((lp for lp in position.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [t.logprob for t in entry.top_logprobs] == [lp.logprob for lp in top]
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [
            lp.decoded_token.encode("utf-8", "surrogateescape") for lp in top
        ]


def test_streamed_chat_concatenates_to_the_whole_response(client):
    request = dict(
        model=MODEL, messages=chat_messages(), max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(
        client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.completion_tokens == 10
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in choices) == whole.message.content
    streamed = [e for c in choices if c.logprobs for e in c.logprobs.content]
    assert streamed == whole.logprobs.content
    assert choices[-1].finish_reason == whole.finish_reason == "length"


# ---- errors -----------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 0}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"stop_token_ids": [-(2**63) - 1]}, "stop_token_ids"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"prompt": [50257]}, "prompt"),
    ({"prompt": "word " * MAX_MODEL_LEN}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
]

BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests_are_400_naming_the_field(http, change, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **change}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert (
        http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}).status_code
        == 200
    )


@pytest.mark.parametrize(("change", "param"), BAD_CHATS)
def test_bad_chat_requests_are_400_naming_the_field(http, change, param):
    body = {"model": MODEL, "messages": chat_messages(), "max_tokens": 2, **change}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_invalid_json_and_non_finite_numbers_are_400(http):
    response = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    body = b'{"model": "builtin:tiny", "prompt": "Hi", "temperature": NaN}'
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"


def test_a_bad_streamed_request_is_400_before_the_stream(http):
    body = {"model": MODEL, "prompt": "Hello", "logprobs": 99, "stream": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_missing_or_wrong_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(
            server + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers=headers
        )
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0) as bad_client:
        with pytest.raises(openai.AuthenticationError):
            bad_client.models.list()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].finish_reason


# ---- other endpoints ----------------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_tokenize_and_detokenize_round_trip(http, tokenizer):
    tokens = http.post("/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert tokens["tokens"] == tokenizer(PROMPTS[1]).input_ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPTS[1]}
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_metrics_count_tokens_and_show_the_kv_cache(http, client):
    before = metric_values(http)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    after = metric_values(http)
    assert after["coreserve:generation_tokens_total"] - before["coreserve:generation_tokens_total"] == 5
    assert after["coreserve:prompt_tokens_total"] - before["coreserve:prompt_tokens_total"] == 5
    assert after["coreserve:kv_blocks_total"] == 256 and after["coreserve:num_requests_running"] == 0
    assert (
        after["coreserve:time_to_first_token_seconds_count"]
        > before["coreserve:time_to_first_token_seconds_count"]
    )
    assert "coreserve:time_per_output_token_seconds_bucket" in http.get("/metrics").text


def metric_values(http) -> dict[str, float]:
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# ---- disconnects --------------------------------------------------------------------------------------


def wait_until_idle(http, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = metric_values(http)
        if (
            values["coreserve:kv_blocks_free"] == values["coreserve:kv_blocks_total"]
            and not values["coreserve:num_requests_running"]
        ):
            return True
        time.sleep(0.1)
    return False


def test_a_stream_dropped_midway_frees_its_blocks(http, server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric_values(http)["coreserve:num_requests_running"] == 1
    assert wait_until_idle(http)


def test_a_non_streamed_request_whose_client_leaves_is_aborted(http, server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=1.0)
    assert wait_until_idle(http)


def test_many_concurrent_streams_all_finish_with_their_token_counts(server):
    import asyncio

    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=3 + i % 5, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(main()) == [3 + i % 5 for i in range(64)]
