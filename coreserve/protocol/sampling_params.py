"""SamplingParams: vLLM's names, validated where they are built (the frontend), checked again just before
they are sent, and checked by the core's typed decoder on arrival.

Every field carries its type and bounds as a msgspec annotation: the same rule for the Python API
(`validate`, a ValueError naming the field) and the wire (the core's decoder refuses what breaks it).
Integers fit the wire's int64; floats are finite (NaN and inf fail the bounds).
"""

from __future__ import annotations

import functools
import sys
import typing
from typing import Annotated, Literal

import msgspec

from coreserve.protocol.pooling_params import PoolingParams
from coreserve.protocol.structured_outputs import StructuredOutputsParams

# vLLM's names: logprobs or logits, of the model's output (raw) or after every logit rule, penalty,
# temperature and filter (processed). "raw" and "processed" are the older names of the logprobs modes.
LogprobsMode = Literal[
    "raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits", "raw", "processed"
]
LOGPROBS_MODES: tuple[str, ...] = typing.get_args(LogprobsMode)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 1024  # completions per prompt: each is a core request; a bound keeps one call from flooding the core
_FLOAT_MAX = sys.float_info.max

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt64 = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
LogprobsK = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]  # -1: the whole vocabulary
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# Below the vocabulary size too: checked against the handshake's facts (frontend) and by the core.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]  # OpenAI's range for logit_bias values
# HF's output_hidden_states index: 0 the embedding output, i layer i's output, L (the last) the final norm's;
# negative ones count from the end, as Python's. Checked against the model's L by the request rules.
HiddenIndex = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
MAX_HIDDEN_INDICES = 1024  # more indices than any model has layers (each is a [positions, hidden] array)
HiddenIndices = Annotated[list[HiddenIndex], msgspec.Meta(min_length=1, max_length=MAX_HIDDEN_INDICES)]
HiddenPositions = Literal["all", "prompt", "output"]
# Candidate ids scored at one prompt position: bounded so a reply stays prompt length x this many values.
MAX_PROMPT_CANDIDATES = 256
CandidateRow = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CANDIDATES)]


class LoraRef(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter on the wire (vLLM's LoRARequest): the core loads `path` (a PEFT folder on the core's
    host) the first time it meets `int_id`, and keeps it under that id."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    int_id: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one prompt's completions. Field names and defaults follow vLLM.

    `logprobs=k` returns the sampled token plus the top-k per generated token (-1: whole vocabulary);
    `prompt_logprobs=k` does the same for every prompt token. `logprobs_mode=None` takes the engine's.
    """

    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=_FLOAT_MAX)] = 1.0  # < 1e-5: greedy
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] = 0  # 0 or -1: no top-k filter
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Logits are divided (or multiplied) by it: below 0.01 a logit of 50 overflows fp16 and NaNs follow.
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0.01, le=2.0)] = 1.0
    seed: Int64 | None = None
    max_tokens: PositiveInt64 | None = 16
    min_tokens: NonNegativeInt64 = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: LogprobsK | None = None
    prompt_logprobs: LogprobsK | None = None
    # Also score these candidate ids at each prompt position (vLLM's name): one row for every position,
    # or one row per position 1..P-1 (row i: the candidates for prompt token i + 1). A flat list is the
    # one row. Implies prompt_logprobs=0 when that is unset; docs/rl.md ("Scoring").
    prompt_logprob_token_ids: list[CandidateRow] | None = None
    # Prompt logprobs of logits / T (vLLM's name); None: the raw logits, whatever the logprobs mode.
    prompt_logprobs_temperature: Annotated[float, msgspec.Meta(ge=1e-5, le=_FLOAT_MAX)] | None = None
    logprobs_mode: LogprobsMode | None = None
    # Added to the logits of these tokens before sampling (after allowed_token_ids, before penalties).
    logit_bias: dict[TokenId, Bias] | None = None
    # Only these tokens may be sampled: every other logit is -inf before sampling.
    allowed_token_ids: list[TokenId] | None = None
    # Keep only the last N prompt tokens (left truncation); -1: the most the model allows.
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # The grammar the output must follow (vLLM's name; docs/structured_outputs.md); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # Speculative decoding off for this request alone (the name of vLLM's per-request switch); its tokens
    # and logprobs are the same either way, only its speed changes (docs/speculative.md).
    disable_spec_decode: bool = False
    # A mixture-of-experts model returns each token's routed experts (vLLM's name; docs/models.md): per
    # position computed, per MoE layer, the top_k expert ids, for a trainer to replay the routing.
    return_routed_experts: bool = False
    # Hidden states (SGLang's name; docs/logprobs.md, "Hidden states"): True, the final norm's output (HF's
    # output_hidden_states[-1]); a list, those indices of HF's tuple (HiddenIndex), in that order. Returned
    # as CompletionOutput.hidden_states [indices, positions, hidden] float32; `hidden_states_positions`:
    # "prompt" (each prompt position), "output" (the position that sampled each output token) or "all"
    # (every position computed: the prompt's, then each output token's but the last's).
    return_hidden_states: bool | HiddenIndices = False
    hidden_states_positions: HiddenPositions = "all"
    # vLLM's: False leaves the text "" and every logprob's decoded_token None (the ids and numbers are the
    # same); lm-eval's in-process vLLM backend scores with it. Stop strings need the text: refused with it.
    detokenize: bool = True
    # Trace replay (vLLM's name): output position i is this list's token i instead of a sampled one, and
    # its logprob row is the model's (raw or processed, as asked) with that token's true logprob and rank;
    # past the list's end tokens are sampled as usual. With batch invariance a replayed rollout gets its
    # own logprobs back bit for bit (docs/rl.md).
    trace_decode_token_ids: list[TokenId] | None = None
    # Sampling replay (SGLang's request name, vLLM's `sampling_mask` output): each generated token's
    # support, the ids the sampler drew from after top-k/top-p/min-p (and any rule, grammar or ban), so
    # a trainer renormalises over the same set. Needs a truncation: else the support is the vocabulary.
    return_sampling_mask: bool = False
    # Pinned weights (as slime pins a rollout): the engine's weight_version must be this one when the
    # request arrives, and an update to other weights while it runs ends it; either is an error naming
    # weight_version. None: any weights (docs/rl.md).
    weight_version: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # vLLM's cache_salt (a prompt dict's key and the servers' request field; carried here to the core):
    # requests read only prefix-cache blocks computed under the same salt, so tenants (or weight versions,
    # as prime-rl salts them) never share cached prefixes. None: the shared, unsalted cache.
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    # The LoRA adapter the request runs with (vLLM's `lora_request`, given to generate beside the params
    # and carried here to the core, as cache_salt is; docs/lora.md). None: the base model.
    lora: LoraRef | None = None
    # A pooling request's PoolingParams (LLM.embed, classify, score; the pooling routes), carried here to
    # the core as lora is; the frontend builds its SamplingParams (docs/serving.md, "Pooling"). None: a
    # generation request.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        rows = self.prompt_logprob_token_ids
        if isinstance(rows, list) and rows and all(isinstance(t, int) for t in rows):
            self.prompt_logprob_token_ids = [rows]  # one flat list: the row for every position
        if self.prompt_logprob_token_ids is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = 0
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first field of the wrong type or out of range. Called when the
        object is built and again before it is sent, so that a field changed afterwards is caught."""
        _check_candidate_widths(self.prompt_logprob_token_ids)
        for name, annotation in _field_types().items():
            value = getattr(self, name)
            try:
                msgspec.convert(value, annotation, strict=True)
            except msgspec.ValidationError as exc:
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {exc}") from None
        for is_kept, message in self._rules_between_fields():
            if not is_kept:
                raise ValueError(message)
        if self.pooling is not None:
            self.pooling.validate()
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
            if self.min_tokens:  # the grammar alone decides where its output may end
                raise ValueError("min_tokens cannot be combined with structured_outputs")

    def _rules_between_fields(self) -> list[tuple[bool, str]]:
        """(kept, the message when broken) for each rule that ties fields together; each field's own type
        and bounds are its annotation's, checked first."""
        return [
            (not self.stop or all(self.stop), "stop strings must not be empty"),
            (self.allowed_token_ids != [], "allowed_token_ids must not be empty (None: every token)"),
            (self.detokenize or not self.stop, "stop strings need the text: they cannot be used with detokenize=False"),
            (
                not self.return_sampling_mask or self.is_greedy or self.top_k > 0 or self.top_p < 1.0
                or self.min_p > 0.0,
                "return_sampling_mask needs top_k, top_p or min_p (without a truncation every token is in "
                "the support)",
            ),
            (
                self.trace_decode_token_ids is None or self.structured_outputs is None,
                "trace_decode_token_ids cannot be combined with structured_outputs (a forced token may "
                "break the grammar)",
            ),
            (self.truncate_prompt_tokens != 0, "truncate_prompt_tokens must be at least 1, or -1"),
            (
                not isinstance(self.return_hidden_states, list)
                or len(set(self.return_hidden_states)) == len(self.return_hidden_states),
                "return_hidden_states: the layer indices must be distinct",
            ),
            (
                self.prompt_logprobs is not None or self.prompt_logprobs_temperature is None,
                "prompt_logprobs_temperature needs prompt_logprobs (the prompt logprobs it scales)",
            ),
            (
                self.prompt_logprobs is not None or self.prompt_logprob_token_ids is None,
                "prompt_logprob_token_ids needs prompt_logprobs (0: the prompt token and the candidates)",
            ),
            (
                all(len(set(row)) == len(row) for row in self.prompt_logprob_token_ids or ()),
                "prompt_logprob_token_ids: the candidate ids of a position must be distinct",
            ),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.seed is None or self.seed + self.n - 1 <= INT64_MAX,
                f"seed + n - 1 must fit int64 (the n completions take seeds seed .. seed + n - 1), "
                f"got seed={self.seed}, n={self.n}",
            ),
        ]

    @property
    def has_logit_rules(self) -> bool:
        """Whether logit_bias or allowed_token_ids change this request's logits before sampling."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def hidden_indices(self) -> list[int] | None:
        """The HF indices of return_hidden_states as asked (-1: the final norm's output); None: not asked."""
        asked = self.return_hidden_states
        if asked is True:
            return [-1]
        return list(asked) if isinstance(asked, list) else None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5


def _check_candidate_widths(rows: object) -> None:
    """A short message for too many candidates (the generic one would print the whole matrix)."""
    if isinstance(rows, list) and rows and isinstance(rows[0], list):
        widest = max(len(row) if isinstance(row, list) else 0 for row in rows)
        if widest > MAX_PROMPT_CANDIDATES:
            raise ValueError(
                f"SamplingParams.prompt_logprob_token_ids has {widest} candidate ids at a position; at most "
                f"{MAX_PROMPT_CANDIDATES} are allowed (MAX_PROMPT_CANDIDATES)"
            )


@functools.cache
def _field_types() -> dict[str, object]:
    """Each field's annotation, bounds included (resolved once; the module uses postponed annotations)."""
    hints = typing.get_type_hints(SamplingParams, include_extras=True)
    return {name: hints[name] for name in SamplingParams.__struct_fields__}
