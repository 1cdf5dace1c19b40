"""A draft model (`method: "draft_model"`): another checkpoint with the model's vocabulary proposes
each request's next tokens by decoding them itself (engine-core process).

The draft has its own KV cache under the model's block tables (the same block ids, the draft's own
shapes), written as it catches up: a request's first proposal prefills the draft over its whole
context; later ones compute only the tokens the draft has not seen (the kept proposals past its last
write, and the model's own token). It samples with the request's own parameters and the same noise
per (seed, output position) as the model's sampler, so where the two distributions agree the draft
proposes the very token the model will sample (greedy: the argmax; sampled: the same exponential race).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec
import torch

from coreserve.protocol.config import SpeculativeConfig
from coreserve.worker.sampling.metadata import build_sampling_metadata
from coreserve.worker.step.input_batch import RequestState
from coreserve.worker.step.runner_spec import RunnerSpec

CATCH_UP_ROWS = 8  # a catch-up of up to this many tokens runs as decode rows (a longer one as a prefill chunk)


class DraftModelProposer:
    def __init__(
        self, spec: RunnerSpec, config: SpeculativeConfig, vocab_size: int, make_runner: Callable[[RunnerSpec], Any]
    ) -> None:
        """`make_runner`: ModelRunner, passed in (the draft is a runner of its own model, without a proposer)."""
        draft_spec = msgspec.structs.replace(
            spec, model=config.model, dtype="auto", speculative=None, tensor_parallel_size=1
        )
        self.runner = make_runner(draft_spec)
        if self.runner.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config model {config.model!r} has a vocabulary of {self.runner.vocab_size} "
                f"tokens, the model {vocab_size}: a draft must share the model's tokenizer"
            )
        self.num_computed: dict[str, int] = {}  # req_id -> positions whose draft KV is written

    def host_kv_bytes(self, num_blocks: int) -> int:
        return self.runner.host_kv_bytes(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.num_computed.clear()  # zeroed: every request catches up from its start

    def release(self) -> None:
        self.runner.kv.free()
        self.num_computed.clear()

    def forget(self, req_id: str) -> None:
        self.num_computed.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, states: list[RequestState], most: list[int]) -> list[list[int]]:
        """Per state, `most` tokens the draft decodes after its context (all of them: the draft has no
        way to tell a bad guess from a good one)."""
        runner = self.runner
        views = [  # no logprob rows: only the tokens
            replace(
                s,
                token_ids=list(s.token_ids),
                num_computed_tokens=self.num_computed.get(s.req_id, 0),
                logprobs_k=None,
                prompt_logprobs_k=None,
            )
            for s in states
        ]
        num_tokens = [len(v.token_ids) - v.num_computed_tokens for v in views]
        drafts: list[list[int]] = [[] for _ in states]
        for step in range(max(most)):
            active = [i for i, k in enumerate(most) if k > step]
            batch = [views[i] for i in active]
            # A short catch-up (the kept proposals past the draft's last write, and the model's token) as
            # decode rows, so that the step stays the fused decode forward; the last row samples.
            short = frozenset(
                views[i].req_id for i in active if 1 < num_tokens[i] <= CATCH_UP_ROWS and views[i].num_computed_tokens
            )
            inputs = runner.prepare(batch, [num_tokens[i] for i in active], short)
            meta = build_sampling_metadata(batch, runner.vocab_size, runner.device)
            rows = None
            if short:  # one row a request: each one's last
                last = {req_id: row for row, req_id in enumerate(inputs.sampled_req_ids)}
                rows = torch.tensor([last[v.req_id] for v in batch], device=runner.device)
            _, out = runner.forward_and_sample(inputs, meta, rows)
            sampled = out.sampled.tolist()
            for i, token in zip(active, sampled):
                views[i].num_computed_tokens += num_tokens[i]
                views[i].token_ids.append(token)
                drafts[i].append(token)
                num_tokens[i] = 1
        for state, k in zip(states, most):
            # written: the context, then the proposals but the last (nothing decoded it)
            self.num_computed[state.req_id] = len(state.token_ids) + k - 1
        return drafts

    def kept(self, req_id: str, num_context: int, num_kept: int) -> None:
        """After verification: of the proposals' KV, the kept ones' is the draft's to keep."""
        if req_id in self.num_computed:
            self.num_computed[req_id] = min(self.num_computed[req_id], num_context + num_kept)
