"""The ids a user request takes on its way to the core, made and parsed here only (frontend process).

A submission (one `generate` of one prompt) is `<request id>@<serial>`: unique however often the user
reuses the request id, so late outputs of an aborted request never reach its successor. With n > 1
each completion is its own core request, `<submission id>#<index>`. The serial after the last `@`
holds neither character, so a user id containing `@` or `#` parses back unchanged.
"""

from __future__ import annotations

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
