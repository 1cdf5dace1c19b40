"""The sampler: logit rules, penalties, temperature, top-k/top-p/min-p, seeded sampling and logprobs
(core process).

Logprobs are computed only for the rows that asked and only up to the largest k among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from coreserve.worker.sampling.grammar_mask import allowed_mass, apply_grammar_mask
from coreserve.worker.sampling.logit_rules import apply_logit_rules
from coreserve.worker.sampling.logprobs import SamplingOps, gather_logprobs
from coreserve.worker.sampling.metadata import Penalties, SamplingMetadata
from coreserve.worker.step.step_tensors import LogprobsTensors


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # rows R' of the requests that asked; None: no row asked
    constraint_masses: torch.Tensor | None = None  # [G] float32 mass each grammar row allowed (raw softmax)
    supports: list[np.ndarray] | None = None  # per meta.mask_rows: the ids sampled from, ascending (host)


class Sampler:
    """`ops`: the backend's vocabulary-wide passes (top-k logprob rows, argmax)."""

    def __init__(self, engine_generator: torch.Generator, ops: SamplingOps) -> None:
        self.generator = engine_generator
        self.ops = ops

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [R, V] float32 (not modified)."""
        processed = self._process(logits, meta)
        masses = None if meta.grammar is None else allowed_mass(logits, meta.grammar)
        rows = meta.logprob_rows
        if rows is None:
            drawn = self._sample(processed, meta)
            return SamplerOutput(_force(drawn, meta), None, masses, _supports(processed, drawn, meta))
        scores = logits if meta.is_all_rows else logits[rows]
        if meta.is_processed is not None:
            chosen_scores = processed if meta.is_all_rows else processed[rows]
            scores = torch.where(meta.is_processed[:, None], chosen_scores, scores)
        top = self.ops.top_logprobs(scores, meta.num_logprobs)
        if processed is logits and meta.all_greedy and meta.is_all_rows:
            sampled = top.ids[:, 0]  # greedy and unprocessed: the top-1 is the argmax, no extra pass
        else:
            sampled = self._sample(processed, meta)
        supports = _supports(processed, sampled, meta)  # what the sampler drew from, before any trace
        sampled = _force(sampled, meta)  # trace replay: the trace's token, its row the model's own
        token_ids, values, ranks = gather_logprobs(top, sampled[rows], meta.num_logprobs)
        if meta.is_logits is not None:  # the logits modes: the same tokens and ranks, their scores' values
            values = torch.where(meta.is_logits[:, None], scores.gather(-1, token_ids.long()), values)
        return SamplerOutput(sampled, LogprobsTensors(token_ids, values, ranks), masses, supports)

    def _process(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logit rules (allowed tokens, bias), the grammar's mask, penalties, min_tokens bans, temperature,
        min-p, top-k, top-p; a copy, or `logits` itself when nothing applies (greedy rows with no penalties
        or rules: the common case, spared a [R, V] copy)."""
        is_filtered = meta.min_p is not None or meta.top_k is not None or meta.top_p is not None
        is_changed = meta.penalties is not None or meta.banned or meta.logit_rules is not None
        is_changed = is_changed or meta.grammar is not None
        if meta.all_greedy and not is_changed and not is_filtered:
            return logits
        logits = logits.clone()
        if meta.logit_rules is not None:
            logits = apply_logit_rules(logits, meta.logit_rules)
        if meta.grammar is not None:  # after the rules: a biased token the grammar forbids stays -inf
            logits = apply_grammar_mask(logits, meta.grammar)
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        for row, token_ids in meta.banned:
            logits[row, token_ids] = float("-inf")
        if not meta.all_greedy:
            logits.div_(meta.temperature[:, None])
        if meta.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]
            logits.masked_fill_(probs < threshold, float("-inf"))
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k, meta.max_top_k)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p)
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = self.ops.argmax(logits)
        if meta.all_greedy:
            return greedy
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)  # exponential race: argmax(p / q), q ~ Exp(1), samples from p
        if any(g is None for g in meta.generators):  # whole rows from the engine's generator: no index
            noise.exponential_(generator=self.generator)  # tensor to copy to the device
        for row, generator in enumerate(meta.generators):
            if generator is not None:  # a seeded row's own noise, the same in any batch
                noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(meta.is_greedy, greedy, sampled)


def _supports(processed: torch.Tensor, drawn: torch.Tensor, meta: SamplingMetadata) -> list | None:
    """Each asking row's support on the host, int32 ids ascending: the tokens whose processed logit is
    finite (what the sampler drew from), or the drawn token alone on a greedy row (argmax, no draw).
    One copy to the host for all asking rows."""
    if not meta.mask_rows:
        return None
    finite = torch.isfinite(processed[meta.mask_rows]).cpu().numpy()
    chosen = drawn[meta.mask_rows].cpu().numpy()
    return [
        chosen[i : i + 1].astype(np.int32) if greedy else np.flatnonzero(finite[i]).astype(np.int32)
        for i, greedy in enumerate(meta.mask_greedy)
    ]


def _force(sampled: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return sampled if meta.forced is None else torch.where(meta.forced >= 0, meta.forced, sampled)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    repetition = p.repetition[:, None].expand_as(logits)
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(p.seen_mask, scaled, logits)
    logits -= p.frequency[:, None] * p.output_counts
    logits -= p.presence[:, None] * (p.output_counts > 0).float()
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    kth_values = logits.topk(max_k, dim=-1).values.gather(-1, (top_k - 1).clamp(max=max_k - 1)[:, None])
    return logits.masked_fill(logits < kth_values, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # keeps the token that crosses top_p
    drop_sorted = mass_before > top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def advance_penalties(penalties: Penalties | None, sampled: torch.Tensor) -> None:
    """Counts the tokens just sampled, in place on the device, for the next step of a multi-step window."""
    if penalties is None:
        return
    index = sampled.unsqueeze(1)
    penalties.output_counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    penalties.seen_mask.scatter_(1, index, True)
