"""The sampler's per-step tensors (`SamplingMetadata`), built from the request states of the rows that
sample (core process)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from coreserve.worker.sampling.grammar_mask import GrammarMask
from coreserve.worker.sampling.logit_rules import LogitRules, build_logit_rules
from coreserve.worker.step.input_batch import RequestState

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class Penalties:
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    repetition: torch.Tensor  # [R] float32
    output_counts: torch.Tensor  # [R, V] float32, how often each token was generated so far
    seen_mask: torch.Tensor  # [R, V] bool, token in the prompt or the output


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [R] float32, 1.0 on greedy rows; None when every row is greedy
    is_greedy: torch.Tensor | None  # [R] bool; None when every row is greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] int64, vocab size where disabled; None when no row filters
    max_top_k: int  # the largest of top_k, known on the host (no device sync to size the topk)
    top_p: torch.Tensor | None  # [R] float32
    min_p: torch.Tensor | None  # [R] float32
    penalties: Penalties | None
    generators: list[torch.Generator | None]  # [R] a generator per seeded row; None: the engine's
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked until min_tokens are generated
    logprob_rows: torch.Tensor | None  # [R'] int64 rows that asked for logprobs
    num_logprobs: int  # largest k among them; -1: whole vocabulary
    is_processed: torch.Tensor | None  # [R'] bool, row wants logprobs after processing; None: no row does
    is_all_rows: bool = False  # every row asked for logprobs: no row gather needed
    is_logits: torch.Tensor | None = None  # [R'] bool, row wants logits, not logprobs; None: no row does
    logit_rules: LogitRules | None = None  # allowed_token_ids and logit_bias; None: no row has them
    grammar: GrammarMask | None = None  # structured outputs' masks; None: no row has a grammar
    forced: torch.Tensor | None = None  # [R] int64 trace replay's token, -1 where sampled; None: no row
    mask_rows: list[int] = field(default_factory=list)  # rows that return their sampling support
    mask_greedy: list[bool] = field(default_factory=list)  # per mask row: greedy (its support: its token)
    device: torch.device = torch.device("cpu")  # where the rows' tensors live


def build_sampling_metadata(
    states: list[RequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    params = [s.params for s in states]
    is_greedy = [p.is_greedy for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    logprob_rows = [i for i, s in enumerate(states) if s.logprobs_k is not None]
    ks = [states[i].logprobs_k for i in logprob_rows]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    all_greedy = all(is_greedy)
    return SamplingMetadata(
        temperature=None
        if all_greedy
        else tensor([1.0 if g else p.temperature for g, p in zip(is_greedy, params)], torch.float32),
        is_greedy=None if all_greedy else tensor(is_greedy, torch.bool),
        all_greedy=all_greedy,
        top_k=tensor(top_k, torch.int64) if min(top_k) < vocab_size else None,
        max_top_k=max(top_k),
        top_p=tensor([p.top_p for p in params], torch.float32)
        if any(p.top_p < 1.0 for p in params)
        else None,
        min_p=tensor([p.min_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params)
        else None,
        penalties=_penalties(states, vocab_size, device),
        generators=[_generator(s, device) for s in states],
        banned=_banned(states),
        logprob_rows=tensor(logprob_rows, torch.int64) if logprob_rows else None,
        num_logprobs=-1 if -1 in ks else max(ks, default=0),
        is_all_rows=len(logprob_rows) == len(states),
        is_processed=tensor([states[i].is_processed for i in logprob_rows], torch.bool)
        if any(states[i].is_processed for i in logprob_rows)
        else None,
        is_logits=tensor([states[i].is_logits for i in logprob_rows], torch.bool)
        if any(states[i].is_logits for i in logprob_rows)
        else None,
        logit_rules=build_logit_rules(params, vocab_size, device),
        device=device,
        forced=_forced(states, device),
        mask_rows=[i for i, p in enumerate(params) if p.return_sampling_mask],
        mask_greedy=[p.is_greedy for p in params if p.return_sampling_mask],
    )


def next_sampling_step(meta: SamplingMetadata, states: list[RequestState]) -> SamplingMetadata:
    """The next step of a multi-step window: the same rows, parameters and penalties (their counts
    advanced in place on the device, since the host's token lists hold placeholders until the window
    ends); what depends on the output position (seeded noise, min_tokens bans) is redone."""
    return replace(
        meta,
        generators=[_generator(s, meta.device) for s in states],
        banned=_banned(states),
        forced=None if meta.forced is None else _forced(states, meta.device),  # the window's rows are fixed
    )


def _forced(states: list[RequestState], device: torch.device) -> torch.Tensor | None:
    """Each row's trace token at its output position (trace_decode_token_ids), -1 past the trace or
    without one; None when no row replays a trace."""
    if all(s.params.trace_decode_token_ids is None for s in states):
        return None
    forced = []
    for state in states:
        trace, position = state.params.trace_decode_token_ids or (), state.num_output_tokens
        forced.append(trace[position] if position < len(trace) else -1)
    return torch.tensor(forced, dtype=torch.int64, device=device)


def _generator(state: RequestState, device: torch.device) -> torch.Generator | None:
    """A seeded row's noise depends only on (seed, output position): the same tokens in any batch."""
    seed = state.params.seed if state.params.seed is not None else state.spec_seed
    if seed is None or state.params.is_greedy:
        return None
    mixed = (seed * _SEED_MIX + state.num_output_tokens) % (2**63)
    return torch.Generator(device=device).manual_seed(mixed)


def _banned(states: list[RequestState]) -> list[tuple[int, list[int]]]:
    banned = []
    for row, state in enumerate(states):
        if state.num_output_tokens < state.params.min_tokens:
            token_ids = list(state.eos_token_ids) + list(state.params.stop_token_ids or ())
            if token_ids:
                banned.append((row, token_ids))
    return banned


def _penalties(states: list[RequestState], vocab_size: int, device: torch.device) -> Penalties | None:
    params = [s.params for s in states]
    if all(
        p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in params
    ):
        return None
    counts = torch.zeros((len(states), vocab_size), dtype=torch.float32, device=device)
    seen = torch.zeros((len(states), vocab_size), dtype=torch.bool, device=device)
    for row, state in enumerate(states):
        output = torch.tensor(state.token_ids[state.num_prompt_tokens :], dtype=torch.int64, device=device)
        counts[row].scatter_add_(0, output, torch.ones_like(output, dtype=torch.float32))
        seen[row, torch.tensor(state.token_ids, dtype=torch.int64, device=device)] = True
    return Penalties(
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        output_counts=counts,
        seen_mask=seen,
    )
