"""The rules a request must keep against the engine's limits, stated once (both processes).

The frontend checks them before a request leaves (`InputProcessor`), the core again on arrival
(`EngineCore.add_request`: a client with a wrong view must not reach the model), and the HTTP server
before the engine sees a request, naming the body's field. Each broken rule is a `RequestRuleError`, a
ValueError whose `param` names the field at fault. The server adds vLLM's stricter length rule
(prompt plus max_tokens within the context) with `is_max_tokens_strict`; the engine caps max_tokens at
the context instead. What one field allows on its own (types, bounds) is `SamplingParams`' annotations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from coreserve.protocol.limits import MAX_HIDDEN_STATES_BYTES
from coreserve.protocol.messages import HandshakeReply
from coreserve.protocol.pooling_params import PoolingFacts
from coreserve.protocol.sampling_params import SamplingParams


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's limits on one request, as the handshake states them."""

    vocab_size: int
    max_model_len: int  # prompt and generated tokens together
    max_logprobs: int  # -1: any k, the whole vocabulary included
    num_kv_blocks: int
    block_size: int  # tokens per KV block
    eos_token_ids: tuple[int, ...] = ()  # banned with the stop token ids until min_tokens are generated
    num_moe_layers: int = 0  # 0: a dense model, no routed experts to return
    num_hidden_layers: int = 0  # L: HF's output_hidden_states has L + 1 entries
    hidden_size: int = 0  # 0: this engine returns no hidden states (hidden_states_refusal says why)
    hidden_states_refusal: str = ""
    runner: str = "generate"  # "pooling": pooling requests alone (check_runner)
    pooling: PoolingFacts | None = None

    @classmethod
    def of(cls, facts: HandshakeReply) -> RequestLimits:
        return cls(
            vocab_size=facts.vocab_size,
            max_model_len=facts.max_model_len,
            max_logprobs=facts.max_logprobs,
            num_kv_blocks=facts.num_kv_blocks,
            block_size=facts.block_size,
            eos_token_ids=tuple(facts.eos_token_ids),
            num_moe_layers=facts.num_moe_layers,
            num_hidden_layers=facts.num_hidden_layers,
            hidden_size=facts.hidden_size,
            hidden_states_refusal=facts.hidden_states_refusal,
            runner=facts.runner,
            pooling=facts.pooling,
        )


class RequestRuleError(ValueError):
    """A request that breaks one of the engine's limits; `param` is the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    limits: RequestLimits,
    *,
    prompt_param: str = "prompt",
    is_max_tokens_strict: bool = False,
) -> None:
    """Every rule, in this order: the runner, the prompt, (vLLM's length rule), logprobs, token id fields,
    a token left to sample under min_tokens, KV room."""
    check_runner(params, limits)
    check_prompt(prompt_token_ids, limits, prompt_param, is_pooling=params.pooling is not None)
    if is_max_tokens_strict:
        check_max_tokens_fit(len(prompt_token_ids), params.max_tokens, limits, prompt_param)
    check_logprobs("logprobs", params.logprobs, limits)
    check_logprobs("prompt_logprobs", params.prompt_logprobs, limits)
    check_prompt_candidates(params.prompt_logprob_token_ids, len(prompt_token_ids), limits.vocab_size)
    check_token_ids("stop_token_ids", params.stop_token_ids or (), limits.vocab_size)
    check_token_ids("logit_bias", params.logit_bias or (), limits.vocab_size)
    check_token_ids("allowed_token_ids", params.allowed_token_ids or (), limits.vocab_size)
    check_token_ids("trace_decode_token_ids", params.trace_decode_token_ids or (), limits.vocab_size)
    check_min_tokens_leave_a_token(params, limits)
    if params.return_routed_experts and not limits.num_moe_layers:
        raise RequestRuleError(
            "return_routed_experts needs a mixture-of-experts model; this model routes no experts",
            "return_routed_experts",
        )
    check_hidden_states(params, len(prompt_token_ids), limits)
    check_kv_room(len(prompt_token_ids), params.max_tokens, limits)


def check_prompt(
    prompt_token_ids: Sequence[int], limits: RequestLimits, param: str = "prompt", is_pooling: bool = False
) -> None:
    """Not empty, shorter than the context (room for one generated token; a pooling prompt may fill it),
    ids in the vocabulary."""
    num = len(prompt_token_ids)
    if num == 0:
        raise RequestRuleError(f"the {param} is empty: there is nothing to complete", param)
    if is_pooling and num > limits.max_model_len:
        raise RequestRuleError(
            f"the {param} has {num} tokens, but max_model_len is {limits.max_model_len} (this model's maximum "
            "context length): truncate it (truncate_prompt_tokens) or shorten it", param,
        )
    if num >= limits.max_model_len and not is_pooling:
        raise RequestRuleError(
            f"the {param} has {num} tokens, but max_model_len is {limits.max_model_len} (this model's "
            "maximum context length): it must be shorter, to leave room for at least one generated token",
            param,
        )
    _check_ids(param, "token id", prompt_token_ids, limits.vocab_size)


# What a pooling request leaves as SamplingParams' defaults: it samples nothing, so any of these set is refused
_UNSAMPLED = ("n", "logprobs", "prompt_logprobs", "prompt_logprob_token_ids", "min_tokens", "stop", "stop_token_ids",
              "logit_bias", "allowed_token_ids", "structured_outputs", "return_routed_experts", "return_hidden_states",
              "trace_decode_token_ids", "return_sampling_mask")


def check_runner(params: SamplingParams, limits: RequestLimits) -> None:
    """A pooling engine serves pooling requests alone, a generating one none; a pooling request's task is
    the model's, its `dimensions` a width the model names, and it sets no sampling field."""
    pooling = params.pooling
    if limits.runner == "pooling" and pooling is None:
        raise RequestRuleError(
            "this engine runs a pooling model (runner='pooling'): it embeds, classifies and scores prompts "
            "(LLM.embed, classify, score, reward; /v1/embeddings, /pooling, /classify, /score, /rerank) and "
            "generates nothing", "prompt",
        )
    if pooling is None:
        return
    facts = limits.pooling
    if limits.runner != "pooling" or facts is None:
        raise RequestRuleError("pooling (embed, classify, score) needs an engine started with runner='pooling' "
                               "(--runner pooling); this one generates", "pooling")
    task = pooling.task or facts.tasks[0]
    if task not in facts.tasks:
        raise RequestRuleError(f"task {task!r} is not this model's: it serves {facts.tasks}", "task")
    check_dimensions(pooling.dimensions, facts)
    if params.lora is not None:
        raise RequestRuleError("a LoRA adapter on a pooling request is not built", "lora")
    defaults = SamplingParams()
    for name in _UNSAMPLED:
        if getattr(params, name) != getattr(defaults, name):
            raise RequestRuleError(f"{name} does not apply to a pooling request (it samples nothing)", name)


def check_dimensions(dimensions: int | None, facts: PoolingFacts) -> None:
    """`dimensions`: a width a Matryoshka model names (config.json's matryoshka_dimensions or
    is_matryoshka), or the embedding's own."""
    if dimensions is None or dimensions == facts.output_size:
        return
    if dimensions in facts.dimensions or (facts.is_any_dimension and dimensions <= facts.output_size):
        return
    named = f"it names {facts.dimensions}" if facts.dimensions else "its config.json names no Matryoshka widths"
    raise RequestRuleError(
        f"dimensions={dimensions}: this model's embeddings have {facts.output_size} values, and {named} "
        "(matryoshka_dimensions or is_matryoshka)", "dimensions",
    )


def check_max_tokens_fit(
    num_prompt_tokens: int, max_tokens: int | None, limits: RequestLimits, param: str = "prompt"
) -> None:
    """vLLM's rule for the OpenAI server: the prompt and max_tokens together fit the context."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > limits.max_model_len:
        raise RequestRuleError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, "
            f"{max_tokens} in the completion). Please reduce the length of the {param} or max_tokens.",
            "max_tokens",
        )


def check_logprobs(name: str, k: int | None, limits: RequestLimits) -> None:
    """At most max_logprobs (-1, the whole vocabulary, only where max_logprobs is -1) and the vocabulary."""
    if k is None:
        return
    if limits.max_logprobs != -1 and (k == -1 or k > limits.max_logprobs):
        asked = f"{k} (the whole vocabulary)" if k == -1 else str(k)
        raise RequestRuleError(
            f"{name}={asked} is more than max_logprobs={limits.max_logprobs}; ask for fewer or raise "
            "the engine's max_logprobs",
            name,
        )
    if k > limits.vocab_size:
        raise RequestRuleError(f"{name}={k} is more than the vocabulary ({limits.vocab_size} tokens)", name)


def check_prompt_candidates(rows: list[list[int]] | None, num_prompt_tokens: int, vocab_size: int) -> None:
    """prompt_logprob_token_ids: one row for every position, or one per scored position (1..P-1), all
    of one width, every id in the vocabulary."""
    if rows is None:
        return
    name = "prompt_logprob_token_ids"
    if len(rows) != 1 and len(rows) != num_prompt_tokens - 1:
        raise RequestRuleError(
            f"{name} has {len(rows)} rows; it takes one row of candidate ids for every prompt position, or "
            f"one row per scored position: {num_prompt_tokens - 1} for this {num_prompt_tokens}-token prompt",
            name,
        )
    if any(len(row) != len(rows[0]) for row in rows):
        raise RequestRuleError(f"{name}: every row must have the same number of candidate ids", name)
    for row in rows:
        _check_ids(name, f"{name}: token id", row, vocab_size)


def check_min_tokens_leave_a_token(params: SamplingParams, limits: RequestLimits) -> None:
    """min_tokens bans the end-of-sequence and stop token ids until that many are generated; with
    allowed_token_ids made of those alone, no token would be left to sample (every logit -inf)."""
    if not params.min_tokens or params.allowed_token_ids is None:
        return
    banned = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(limits.eos_token_ids))
    if set(params.allowed_token_ids) <= banned:
        raise RequestRuleError(
            f"allowed_token_ids {sorted(set(params.allowed_token_ids))[:8]} are all end-of-sequence or stop "
            f"tokens, which min_tokens={params.min_tokens} bans until {params.min_tokens} tokens are "
            "generated: no token could be sampled; allow another token or drop min_tokens",
            "allowed_token_ids",
        )


def check_token_ids(name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """Every id of a token-id field (stop_token_ids, logit_bias keys, allowed_token_ids) in the vocabulary."""
    _check_ids(name, f"{name}: token id", token_ids, vocab_size)


def resolved_hidden_indices(indices: Sequence[int], num_layers: int) -> list[int]:
    """HF's indices 0..L as asked (a negative one counts from the end: -1 is L, the final norm's)."""
    return [i % (num_layers + 1) for i in indices]


def check_hidden_states(params: SamplingParams, num_prompt_tokens: int, limits: RequestLimits) -> None:
    """return_hidden_states: an engine that returns them, indices within HF's tuple (0..L, or -(L + 1)..-1)
    and distinct once resolved, and no more than MAX_HIDDEN_STATES_BYTES at the request's longest."""
    indices, name = params.hidden_indices, "return_hidden_states"
    if indices is None:
        return
    if not limits.hidden_size:
        why = limits.hidden_states_refusal or "this engine core does not return them"
        raise RequestRuleError(f"return_hidden_states is not available: {why}", name)
    num_layers = limits.num_hidden_layers
    bad = next((i for i in indices if not -(num_layers + 1) <= i <= num_layers), None)
    if bad is not None:
        raise RequestRuleError(
            f"return_hidden_states index {bad} is outside HF's output_hidden_states of this model: 0 (the "
            f"embedding output) to {num_layers} (the final norm's output), or -{num_layers + 1} to -1", name,
        )
    if len(set(resolved_hidden_indices(indices, num_layers))) != len(indices):
        raise RequestRuleError(f"return_hidden_states {indices} names one layer twice", name)
    num_bytes = len(indices) * _hidden_positions(params, num_prompt_tokens, limits) * limits.hidden_size * 4
    if num_bytes > MAX_HIDDEN_STATES_BYTES:
        raise RequestRuleError(
            f"return_hidden_states asks for up to {num_bytes} bytes ({len(indices)} layers x positions x "
            f"{limits.hidden_size} float32 values), more than the {MAX_HIDDEN_STATES_BYTES} a request may "
            "have: ask for fewer layers, fewer positions (hidden_states_positions) or a lower max_tokens", name,
        )


def _hidden_positions(params: SamplingParams, num_prompt_tokens: int, limits: RequestLimits) -> int:
    """The most positions whose hidden states the request may get back (hidden_states_positions)."""
    max_tokens = min(params.max_tokens or limits.max_model_len, limits.max_model_len - num_prompt_tokens)
    return {
        "prompt": num_prompt_tokens,
        "output": max_tokens,
        "all": num_prompt_tokens + max_tokens - 1,
    }[params.hidden_states_positions]


def check_kv_room(num_prompt_tokens: int, max_tokens: int | None, limits: RequestLimits) -> None:
    """The request must fit the KV cache alone, at its longest: else it could never finish."""
    max_len = min(num_prompt_tokens + (max_tokens or limits.max_model_len), limits.max_model_len)
    needed = -(-max_len // limits.block_size)
    if needed > limits.num_kv_blocks:
        raise RequestRuleError(
            f"the request may need {needed} KV blocks ({max_len} tokens), but the cache has "
            f"{limits.num_kv_blocks}; lower max_tokens or raise num_kv_blocks",
            "max_tokens",
        )


def _check_ids(param: str, what: str, token_ids: Iterable[int], vocab_size: int) -> None:
    if isinstance(token_ids, list) and token_ids and min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return  # the common case at C speed: a long prompt's ids are not walked in Python
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None and bad < 0:
        raise RequestRuleError(
            f"{what} {bad} is negative: {param} must be token ids greater than or equal to 0 (and below "
            f"the vocabulary's {vocab_size})",
            param,
        )
    if bad is not None:
        raise RequestRuleError(
            f"{what} {bad} is out of vocabulary; the vocabulary has {vocab_size} tokens, so {param} "
            f"must be token ids in [0, {vocab_size})",
            param,
        )
