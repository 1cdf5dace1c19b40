"""Messages and codec: typed decoding, malformed frames, compact logprob arrays."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from coreserve.protocol.arrays import LogprobsArrays
from coreserve.protocol.codec import Codec
from coreserve.protocol.messages import (
    AddRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    GetStats,
    Heartbeat,
)
from coreserve.protocol.sampling_params import SamplingParams


def random_logprobs(rows: int, cols: int, seed: int = 0) -> LogprobsArrays:
    rng = np.random.default_rng(seed)
    return LogprobsArrays.from_numpy(
        rng.integers(0, 50257, (rows, cols), dtype=np.int32),
        -rng.random((rows, cols), dtype=np.float32) * 10,
        rng.integers(1, 100, rows, dtype=np.int32),
    )


def test_requests_round_trip_with_their_sampling_params():
    codec = Codec()
    params = SamplingParams(temperature=0.5, stop="x", logprobs=3, seed=9)
    request = EngineCoreRequest("r1", [1, 2, 3], params, 1.5)
    decoded = codec.decode_client(codec.encode_requests([request]))
    assert isinstance(decoded, AddRequests)
    assert codec.decode_request(decoded.requests[0]) == request
    assert codec.decode_request(decoded.requests[0]).sampling_params.stop == ["x"]


def test_outputs_round_trip_and_arrays_decode_as_views():
    codec = Codec()
    arrays = random_logprobs(3, 6)
    message = EngineCoreOutputs([EngineCoreOutput("r", [4, 5, 6], arrays, None, FinishReason.LENGTH)], 2.0)
    decoded = codec.decode_core(codec.encode(message))
    out = decoded.outputs[0]
    assert isinstance(out.new_logprobs.token_ids, memoryview)
    np.testing.assert_array_equal(out.new_logprobs.token_ids_np(), arrays.token_ids_np())
    np.testing.assert_array_equal(out.new_logprobs.logprobs_np(), arrays.logprobs_np())
    assert out.finish_reason == FinishReason.LENGTH and out.prompt_logprobs is None


@pytest.mark.parametrize("frame", [b"", b"\x93\x01\x02", b"garbage", Codec().encode(EngineCoreOutputs([]))])
def test_malformed_or_misdirected_frames_are_rejected(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        Codec().decode_client(frame)


def test_a_request_with_invalid_sampling_values_is_rejected_alone():
    codec = Codec()
    good = codec.encode_requests([EngineCoreRequest("r", [1], SamplingParams(), 0.0)] * 2)
    bad = good.replace(codec.encode(SamplingParams()), codec.encode({"temperature": -3.0}), 1)
    frame = codec.decode_client(bad)  # the frame itself is well formed
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        codec.decode_request(frame.requests[0])
    assert codec.decode_request(frame.requests[1]).sampling_params == SamplingParams()


def test_wire_message_of_64_rows_by_21_logprobs_is_within_15_percent_of_raw_bytes():
    codec = Codec()
    raw_one = random_logprobs(64, 21)
    one_request = codec.encode(EngineCoreOutputs([EngineCoreOutput("17", list(range(64)), raw_one)], 1.0))
    assert len(one_request) <= 1.15 * raw_one.num_bytes
    # A decode step: 64 requests with one new token each, 20 logprobs apiece.
    rows = [random_logprobs(1, 21, seed) for seed in range(64)]
    step = EngineCoreOutputs([EngineCoreOutput(str(i), [i], rows[i]) for i in range(64)], 1.0)
    assert len(codec.encode(step)) <= 1.15 * sum(r.num_bytes for r in rows)


def test_stats_request_and_answer_round_trip():
    codec = Codec()
    assert codec.decode_client(codec.encode(GetStats(7))) == GetStats(7)
    stats = EngineStats(7, 3, 1, 90, 128, 2)
    assert codec.decode_core(codec.encode(stats)) == stats


def test_heartbeat_is_a_few_bytes():
    assert len(Codec().encode(Heartbeat())) < 8
