"""The wire's frame limits (coreserve/protocol/limits.py): the frontend's largest frame fits the core's cap."""

from __future__ import annotations

from coreserve.protocol.codec import Codec
from coreserve.protocol.limits import MAX_INPUT_FRAME_BYTES, MAX_TOKEN_BYTES, MAX_TOKENS_PER_FRAME
from coreserve.protocol.messages import EngineCoreRequest
from coreserve.protocol.sampling_params import INT64_MAX, SamplingParams


def test_a_frame_of_the_most_prompt_tokens_at_their_widest_fits_the_cores_frame_limit():
    params = SamplingParams(logit_bias={i: 1.0 for i in range(100)}, stop=["x" * 100] * 10)
    request = EngineCoreRequest("r" * 200, [INT64_MAX] * MAX_TOKENS_PER_FRAME, params, 0.0)
    frame = Codec().encode_requests([request])
    assert MAX_TOKENS_PER_FRAME * MAX_TOKEN_BYTES <= len(frame) < MAX_INPUT_FRAME_BYTES

