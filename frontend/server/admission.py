"""How much work the server takes on at once (frontend process, HTTP server).

With `--max-queued-requests Q` the server holds at most the engine's `max_num_seqs` + Q sequences
(running and waiting, each prompt times n counted); a request past that is refused at once with a 503,
`Retry-After` and OpenAI's error shape (code `overloaded`), instead of queueing without end and timing
out in silence. A request bigger than the bound alone is still taken when nothing else is held. Without
the flag nothing is bounded (vLLM's behaviour: a batch client may send thousands at once).
docs/serving.md.
"""

from __future__ import annotations

from frontend.server.errors import APIError

RETRY_AFTER_S = 1  # what Retry-After says: about one decode window of a loaded CPU server


class Admission:
    def __init__(self, max_num_seqs: int, max_queued: int | None) -> None:
        self.bound = None if max_queued is None else max_num_seqs + max_queued
        self.held = 0  # sequences admitted and not yet closed

    def admit(self, sequences: int) -> None:
        """Takes `sequences` on, or raises the 503."""
        if self.bound is not None and self.held and self.held + sequences > self.bound:
            raise APIError(
                503,
                f"the server is at its bound of {self.bound} sequences (max_num_seqs + --max-queued-requests) "
                f"and holds {self.held}: retry after {RETRY_AFTER_S} s",
                code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.held += sequences

    def release(self, sequences: int) -> None:
        self.held -= sequences
