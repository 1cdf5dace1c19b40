"""Prompt lookup (`method: "ngram"`): the tokens that followed the latest earlier occurrence of the
context's last n tokens, n from prompt_lookup_max down to prompt_lookup_min (engine-core process)."""

from __future__ import annotations

from coreserve.protocol.prompt_lookup import lookup
from coreserve.worker.step.input_batch import RequestState


class NgramProposer:
    def __init__(self, shortest: int, longest: int) -> None:
        self.shortest, self.longest = shortest, longest

    def propose(self, states: list[RequestState], most: list[int]) -> list[list[int]]:
        """Per state, at most `most` tokens (none where the context does not repeat its end)."""
        return [lookup(state.token_ids, self.shortest, self.longest, k) for state, k in zip(states, most)]

    # Nothing per request, no KV cache of its own.
    def forget(self, req_id: str) -> None:
        pass

    def kept(self, req_id: str, num_context: int, num_kept: int) -> None:
        pass

    def host_kv_bytes(self, num_blocks: int) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def release(self) -> None:
        pass
