"""A bounded fuzz of the daemon's input socket (about 10,000 random, truncated, nested and mistyped
frames, from a greeted and an unknown client) and of the Python API; then a normal request succeeds
and every KV block is free."""

from __future__ import annotations

import random
import time

import pytest
from conftest import PROMPTS, free_blocks_are_all, running_daemon
from test_core_boundary import RawClient

from coreserve import LLM, SamplingParams
from coreserve.protocol.messages import AbortRequests, EngineCoreRequest, GetStats, Goodbye, Heartbeat, Hello
from coreserve.protocol.model_facts import tokenizer_fingerprint

NUM_FRAMES = 10_000
ODD_VALUES = [
    None,
    True,
    -1,
    0,
    2**63,
    2**64 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    [],
    {},
    [1],
    b"\x00",
]


def random_request(rng: random.Random) -> list:
    """An EngineCoreRequest's four fields, each either well formed or one of ODD_VALUES; sampling
    params with at most a few tokens to generate when they happen to be valid."""
    fields = [
        f"fuzz-{rng.randrange(10**6)}",
        [rng.randrange(50257) for _ in range(rng.randrange(1, 8))],
        {
            "max_tokens": rng.choice([1, 2, 0, -5, 2.5, "3", 2**64 - 1]),
            "temperature": rng.choice([0.0, -1.0, 1.0]),
        },
        0.0,
    ]
    for index in rng.sample(range(4), rng.randrange(0, 3)):
        fields[index] = rng.choice(ODD_VALUES)
    return fields


def random_frame(rng: random.Random, codec, good_frames: list[bytes]) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1:
        frame = rng.choice(good_frames)
        return frame[: rng.randrange(len(frame))]
    if kind == 2:
        depth = rng.randrange(50, 5000)
        return b"\x92\xa3add" + rng.choice([b"\x91", b"\x81\xa1k"]) * depth + b"\xc0"
    if kind == 3:
        return codec.encode(["add", [random_request(rng) for _ in range(rng.randrange(1, 4))]])
    if kind == 4:
        return codec.encode(
            [rng.choice(["beat", "abort", "getstats", "bye", "nope", 7]), rng.choice(ODD_VALUES)]
        )
    frame = bytearray(rng.choice(good_frames))
    frame[rng.randrange(len(frame))] = rng.randrange(256)  # one flipped byte
    return bytes(frame)


@pytest.fixture(scope="module")
def daemon(tiny_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('fuzz')}/core"
    with running_daemon(tiny_path, address, "--log-level", "ERROR") as proc:
        yield address, proc


def test_ten_thousand_hostile_frames_then_normal_service(daemon, tiny_path):
    address, proc = daemon
    rng = random.Random(1234)
    greeted, stranger = RawClient(address), RawClient(address)
    assert greeted.hello(tokenizer_fingerprint(tiny_path)).error is None
    codec = greeted.codec
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), 0.0)
    good_frames = [
        codec.encode_requests([request, request]),
        codec.encode(Hello(3, "abc")),
        codec.encode(AbortRequests(["a", "b"])),
        codec.encode(GetStats(5)),
        codec.encode(Heartbeat()),
        codec.encode(Goodbye()),
    ]
    started = time.monotonic()
    for i in range(NUM_FRAMES):
        frame = random_frame(rng, codec, good_frames)
        (greeted if i % 2 else stranger).send(frame)
        if i % 500 == 0:
            greeted.receive(0.01)  # keep its output queue short
    greeted.send(codec.encode(Goodbye()))  # whatever valid requests the fuzz made are aborted
    greeted.close()
    stranger.close()
    assert time.monotonic() - started < 60 and proc.poll() is None
    with LLM(tiny_path, core_address=address) as llm:
        for kwargs in [dict(max_tokens=2.5), dict(logprobs=True), dict(seed=2**70), dict(temperature=1e309)]:
            with pytest.raises(ValueError):
                llm.generate(PROMPTS[0], SamplingParams(**kwargs), use_tqdm=False)
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
        deadline = time.monotonic() + 10
        while not free_blocks_are_all(llm) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert free_blocks_are_all(llm)
