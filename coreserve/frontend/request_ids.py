"""The ids (and per-completion params) a user request takes to the core, made and parsed here only
(frontend process).

A submission (one `generate` of one prompt) is `<request id>@<serial>`: unique however often the user
reuses the request id, so late outputs of an aborted request never reach its successor. With n > 1
each completion is its own core request, `<submission id>#<index>`. The serial after the last `@`
holds neither character, so a user id containing `@` or `#` parses back unchanged.
"""

from __future__ import annotations

import msgspec

from coreserve.protocol.sampling_params import SamplingParams

_SERIAL_MARK = "@"
_CHILD_MARK = "#"


def submission_id(request_id: str, serial: int) -> str:
    """The id of one submission of `request_id`; `serial` is unique per issuer."""
    return f"{request_id}{_SERIAL_MARK}{serial}"


def request_id_of(submission: str) -> str:
    """The user's request id a `submission_id` was made from."""
    return submission.rpartition(_SERIAL_MARK)[0]


def child_ids(submission: str, num_children: int) -> list[str]:
    """The core request ids of a submission's completions: itself when it has one, else one per index."""
    if num_children == 1:
        return [submission]
    return [f"{submission}{_CHILD_MARK}{i}" for i in range(num_children)]


def parent_of(core_req_id: str) -> str:
    """The submission a core request id belongs to (the id itself for a single completion)."""
    if core_req_id.rfind(_CHILD_MARK) > core_req_id.rfind(_SERIAL_MARK):  # '#<index>' after the serial
        return core_req_id.rpartition(_CHILD_MARK)[0]
    return core_req_id


def child_params(submission: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """n > 1: one core request per completion, seeds offset by the index, prompt logprobs only once."""
    if params.n == 1:
        return [(submission, params)]
    return [
        (
            child_id,
            msgspec.structs.replace(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            ),
        )
        for i, child_id in enumerate(child_ids(submission, params.n))
    ]
