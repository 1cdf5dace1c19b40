"""A step's results on the device, by name, and their one copy to the host (engine-core process).

The runner collects each model step's sampled tokens and logprob rows, and each prompt chunk's
prompt logprobs, into `StepTensors`; `to_host()` moves them all in one device-to-host copy and hands
them back under the same names, ready to become a ModelRunnerOutput, whole, with the step's
`StepExtras` (what some requests ask for beside their tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from coreserve.protocol.step import HostLogprobs, ModelRunnerOutput


class LogprobsTensors(NamedTuple):
    token_ids: torch.Tensor  # [R, k + 1] int32, column 0 = the sampled (or prompt) token
    logprobs: torch.Tensor  # [R, k + 1] float32
    ranks: torch.Tensor  # [R] int32, 1-based rank of column 0
    candidate_ranks: torch.Tensor | None = None  # [R, C] int32: the last C columns are candidate ids

    def present(self) -> list[torch.Tensor]:
        return [tensor for tensor in self if tensor is not None]

    def to_host(self) -> HostLogprobs:
        return HostLogprobs(*copy_to_host(self.present()))


@dataclass
class StepExtras:
    """What a step returns beside tokens and logprob rows, on the host, by request (ModelRunnerOutput's
    fields of the same names; coreserve/worker/step_extras.py builds them where a request asks)."""

    routed_experts: dict[str, list] = field(default_factory=dict)  # req_id -> [(first position, rows)]
    sampling_masks: dict[str, list[np.ndarray]] = field(default_factory=dict)  # req_id -> a support a row
    constraint_masses: dict[str, list[float]] = field(default_factory=dict)  # req_id -> a mass a row
    num_draft_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> proposals verified
    # return_hidden_states: req_id -> [(first position, [its indices, rows, hidden] float32)]
    hidden_states: dict[str, list] = field(default_factory=dict)

    def merge(self, later: StepExtras) -> None:
        """A multi-step window's steps, one after the other (a later step's rows come later)."""
        pairs = (
            (self.routed_experts, later.routed_experts),
            (self.sampling_masks, later.sampling_masks),
            (self.hidden_states, later.hidden_states),
        )
        for into, parts in pairs:
            for req_id, rows in parts.items():
                into.setdefault(req_id, []).extend(rows)


@dataclass
class HostStep:
    sampled_token_ids: np.ndarray  # [num_sampled_reqs, num_steps] int32
    logprobs: list[HostLogprobs]  # one per model step, rows follow the requests that asked
    prompt_logprobs: dict[str, HostLogprobs]
    pooled: dict[str, np.ndarray] = field(default_factory=dict)  # runner="pooling": req_id -> [size] float32

    def runner_output(
        self, sampled_req_ids: list[str], logprob_req_ids: list[str], extras: StepExtras | None
    ) -> ModelRunnerOutput:
        """The step's output, whole: `extras` None where no request asked for any."""
        return ModelRunnerOutput(
            sampled_req_ids,
            self.sampled_token_ids,
            logprob_req_ids if self.logprobs else [],
            self.logprobs,
            self.prompt_logprobs,
            pooled=self.pooled,
            **({} if extras is None else vars(extras)),
        )


@dataclass
class StepTensors:
    sampled: list[torch.Tensor] = field(default_factory=list)  # per model step: [num_sampled_reqs] int64
    logprobs: list[LogprobsTensors] = field(default_factory=list)  # per model step, where rows asked
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)

    def add_step(self, sampled: torch.Tensor, logprobs: LogprobsTensors | None) -> None:
        self.sampled.append(sampled)
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def to_host(self) -> HostStep:
        """Everything in one copy (copy_to_host packs the tensors into one buffer), split back by name."""
        sampled = []
        if len(self.sampled) == 1:
            sampled = [self.sampled[0].unsqueeze(1)]
        elif self.sampled:
            sampled = [torch.stack(self.sampled, dim=1)]
        rows = [*self.logprobs, *self.prompt_logprobs.values()]
        arrays = iter(copy_to_host([*sampled, *(tensor for triple in rows for tensor in triple.present())]))
        sampled_ids = next(arrays) if sampled else np.zeros((0, 1), dtype=np.int32)
        host_rows = [HostLogprobs(*(next(arrays) for _ in triple.present())) for triple in rows]
        return HostStep(
            sampled_ids,
            host_rows[: len(self.logprobs)],
            dict(zip(self.prompt_logprobs, host_rows[len(self.logprobs) :])),
        )


def copy_to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """One device-to-host copy for many int32/float32 tensors: packed into one int32 buffer, then split.
    On the CPU, where the device is the host, each is copied out through numpy instead (a handful of
    torch calls fewer a step: each costs tens of us once the step's weights have evicted torch's
    code from the caches)."""
    if not tensors:
        return []
    if all(t.is_cpu for t in tensors):
        return [
            np.array(t.numpy(), dtype=np.float32 if t.dtype == torch.float32 else np.int32) for t in tensors
        ]
    flat = [
        t.contiguous().view(torch.int32).reshape(-1)
        if t.dtype == torch.float32
        else t.to(torch.int32).reshape(-1)
        for t in tensors
    ]
    host = torch.cat(flat).cpu().numpy()
    out, offset = [], 0
    for tensor in tensors:
        size = tensor.numel()
        chunk = host[offset : offset + size].reshape(tuple(tensor.shape))
        out.append(chunk.view(np.float32) if tensor.dtype == torch.float32 else chunk)
        offset += size
    return out


def logprob_req_ids(states: list) -> list[str]:
    """The ids of the requests (RequestState) that asked for sample logprobs, in order."""
    return [s.req_id for s in states if s.logprobs_k is not None]
