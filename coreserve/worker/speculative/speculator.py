"""The runner's speculative decoding (engine-core process): its proposer, a seed for each unseeded
sampled request, each step's proposals appended for verification, and the kept tokens of a verified
step in the multi-step shape (coreserve/worker/speculative/verification.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from coreserve.protocol.step import HostLogprobs, ModelRunnerOutput, SchedulerOutput
from coreserve.worker.sampling.sampler import SamplerOutput
from coreserve.worker.speculative.proposers import Proposer, make_proposer
from coreserve.worker.speculative.verification import Verification, accept, kept_output
from coreserve.worker.step.input_batch import RequestState
from coreserve.worker.step.runner_spec import RunnerSpec
from coreserve.worker.step.step_tensors import StepExtras, logprob_req_ids


class Speculator:
    def __init__(self, proposer: Proposer, seed: int) -> None:
        self.proposer = proposer
        self.seeds = torch.Generator().manual_seed(seed + 1)

    @classmethod
    def build(cls, spec: RunnerSpec, vocab_size: int, make_runner: Callable[[RunnerSpec], Any]) -> Speculator | None:
        """None where the spec has no speculative config; `make_runner` builds a draft model's runner."""
        proposer = make_proposer(spec, vocab_size, make_runner)
        return None if proposer is None else cls(proposer, spec.seed)

    def adopt(self, state: RequestState) -> None:
        """A new (or resumed) request: speculation samples each position from (seed, position), so an
        unseeded sampled request gets a seed of its own."""
        if state.params.seed is None and not state.params.is_greedy:
            state.spec_seed = int(torch.randint(0, 2**62, (1,), generator=self.seeds))

    def propose(
        self, states: list[RequestState], num_tokens: list[int], scheduler_output: SchedulerOutput
    ) -> Verification | None:
        """Proposals for the requests the scheduler let speculate (its own for a grammar request, in
        spec_drafts), appended to their token lists and their step's tokens; None where there are none."""
        most, given = scheduler_output.spec_tokens, scheduler_output.spec_drafts
        if not most:
            return None
        chosen = [i for i, s in enumerate(states) if s.req_id in most and s.req_id not in given]
        proposals = self.proposer.propose([states[i] for i in chosen], [most[states[i].req_id] for i in chosen]) if chosen else []
        for i, s in enumerate(states):
            if s.req_id in given:
                chosen.append(i)
                proposals.append(given[s.req_id])
        drafts = {}
        for i, tokens in zip(chosen, proposals):
            if tokens:
                drafts[states[i].req_id] = tokens
                states[i].token_ids.extend(tokens)
                num_tokens[i] += len(tokens)
        return Verification(drafts) if drafts else None

    def verified(
        self,
        verification: Verification,
        states: list[RequestState],
        row_req_ids: list[str],
        out: SamplerOutput,
        prompt_logprobs: dict[str, HostLogprobs],
        extras: StepExtras | None,
    ) -> ModelRunnerOutput:
        """The step's output: the kept tokens of every sampled request (`states`; a verified one's
        agreeing proposals and the model's token after them) with their logprob rows and masses, and
        the step's prompt logprob rows; the rejected proposals' KV left behind as not computed, here
        and in a draft model's cache."""
        by_id = {s.req_id: s for s in states}
        num_context = {r: len(by_id[r].token_ids) - len(d) for r, d in verification.drafts.items()}
        kept = accept(verification, states, row_req_ids, out.sampled.tolist())
        for req_id, drafts in verification.drafts.items():
            num_kept = len(kept[req_id]) - 1
            by_id[req_id].num_computed_tokens -= len(drafts) - num_kept
            self.proposer.kept(req_id, num_context[req_id], num_kept)
        asked = logprob_req_ids(states)
        host = kept_output(kept, row_req_ids, asked, out.logprobs, prompt_logprobs)
        masses = {} if extras is None else extras.constraint_masses
        extras = replace(
            extras or StepExtras(),
            constraint_masses={r: rows[: len(kept[r])] for r, rows in masses.items()},
            num_draft_tokens={r: len(d) for r, d in verification.drafts.items()},
        )
        return host.runner_output(list(kept), asked, extras)
