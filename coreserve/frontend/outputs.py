"""What users get back, with vLLM's names: Logprob, CompletionOutput, RequestOutput (frontend process)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np


class Logprob(msgspec.Struct, gc=False):
    """One candidate token at one position. `rank` is 1-based: 1 + tokens with a strictly higher logprob
    (for the top-k entries, their place in the top-k). `decoded_token` is the token's own text; for a
    token whose bytes are not valid UTF-8 on their own, undecodable bytes are kept as surrogate escapes:
    `decoded_token.encode("utf-8", "surrogateescape")` gives the raw bytes back.

    Built like vLLM's dataclass (positional or keyword, same fields, repr and equality), but a struct
    the cyclic garbage collector does not track: it holds no references that could form a cycle, and
    tracking ~100,000 of them per generate call made the collector the largest cost of logprobs=5 in
    the frontend (docs/decisions.md). `msgspec.structs.asdict` stands in for `dataclasses.asdict`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SamplingMask:
    """vLLM's: generated token i was drawn from token_ids[offsets[i]:offsets[i + 1]] (ascending ids), the
    support left after top-k/top-p/min-p and any rule, grammar or ban; a greedy token's is itself."""

    token_ids: np.ndarray  # [total] int32
    offsets: np.ndarray  # [num_tokens + 1] int64

    @classmethod
    def of(cls, rows: list[np.ndarray]) -> SamplingMask:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(r) for r in rows])
        ids = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, dtype=np.int32)
        return cls(ids, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.token_ids[self.offsets[index] : self.offsets[index + 1]]


PositionLogprobs = dict[int, Logprob]  # token id -> Logprob; the sampled (or prompt) token first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With structured_outputs and logprobs, one per token: the probability the model's own distribution
    # gave the tokens the grammar allowed there (docs/structured_outputs.md); None otherwise.
    constraint_masses: list[float] | None = None
    # With return_routed_experts (a mixture of experts), once finished: [positions, MoE layers, top_k]
    # int16, the experts each computed position was routed to, most probable first (docs/models.md)
    routed_experts: np.ndarray | None = None
    # With return_sampling_mask: each token's support (streaming: the new tokens')
    sampling_mask: SamplingMask | None = None
    # With return_hidden_states, once finished: [indices asked, positions, hidden] float32, HF's
    # output_hidden_states at each position of hidden_states_positions ("all": 0 .. prompt + tokens - 2;
    # "prompt": the prompt's; "output": row j the state whose logits gave token j); docs/logprobs.md
    hidden_states: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int | None = None  # prompt tokens read from the prefix cache (n > 1: the most)
    weight_version: int = 0  # the engine's weights that computed this output: 0, then +1 per update_weights
