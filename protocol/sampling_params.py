"""SamplingParams: vLLM's names, validated where they are built (the frontend), carried on the wire."""

from __future__ import annotations

from typing import Literal

import msgspec

LogprobsMode = Literal["raw", "processed"]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one prompt's completions. Field names and defaults follow vLLM.

    `logprobs=k` returns the sampled token plus the top-k per generated token (-1: whole vocabulary);
    `prompt_logprobs=k` does the same for every prompt token. `logprobs_mode=None` takes the engine's.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: LogprobsMode | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= 2.0,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or self.logprobs >= -1,
                f"logprobs must be -1, 0 or positive, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= -1,
                f"prompt_logprobs must be -1, 0 or positive, got {self.prompt_logprobs}",
            ),
            (not self.stop or all(self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5
