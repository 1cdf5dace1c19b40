"""ModelRunner: owns the model, the paged KV cache and the sampler; turns a SchedulerOutput into a
ModelRunnerOutput with one device-to-host copy per step (engine-core process). It is the in-process
`Executor` (worker/executor.py), and each tensor-parallel rank's runner.

It chooses the model's backend once, at load: the C kernels on the CPU for fp32 and bf16 weights
(fp32 activations and KV cache; worker/cpu/), torch's ops elsewhere or without a compiler. And it
chooses each step's path: the fused decode forward where it applies, else the model op by op.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from protocol.step import ModelRunnerOutput, SchedulerOutput
from worker.cpu.fused_decode import FusedForward
from worker.cpu.huge_pages import (
    COLLAPSE_DELAY_S,
    collapse_in_background,
    place_linear_weights,
    zero_page_tensors,
)
from worker.cpu.kernels import CpuKernels, load_cpu_kernels
from worker.cpu.ops import apply_cpu_backend
from worker.executor import RunnerSpec
from worker.grammar_mask import build_grammar_mask
from worker.input_batch import RequestState, StepInputs, build_step_inputs, next_window_step
from worker.logprobs import candidate_ids, prompt_logprobs
from worker.models.llama import LlamaModel
from worker.models.loader import load_model
from worker.parallel.group import TensorParallelGroup
from worker.parallel.sharding import Shard, apply_tp
from worker.sampler import Sampler, SamplerOutput, advance_penalties
from worker.sampling_metadata import build_sampling_metadata, next_sampling_step
from worker.step_tensors import LogprobsTensors, StepTensors

logger = logging.getLogger(__name__)

_PLACEHOLDER = -1  # a token sampled on the device whose value the host has not seen yet


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(
        self,
        spec: RunnerSpec,
        on_progress: Callable[[], None] | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        self.device = pick_device(spec.device) if group is None else group.device
        self.block_size = spec.block_size
        self.group = group
        shard = None if group is None else Shard(group.rank, group.size)
        begun = time.perf_counter()
        self.cpu_kernels: CpuKernels | None = None  # chosen by _place, once the weights' dtype is known
        place = functools.partial(self._place, can_use_kernels=spec.can_use_cpu_kernels)
        self.huge_page_memory: torch.Tensor | None = None  # the linear weights' mapping, set by _place
        self.model = load_model(spec.model, spec.dtype, self.device, shard, place)  # "auto": the checkpoint's
        self.last_step_at = 0.0  # time.monotonic() of the last step with tokens: the collapse waits on it
        if self.huge_page_memory is not None:  # written: now into huge pages, off the first token's path
            collapse_in_background(self.huge_page_memory, busy=self._stepped_lately, delay_s=COLLAPSE_DELAY_S)
            self.huge_page_memory = None
        if self.cpu_kernels is not None:
            apply_cpu_backend(self.model, self.cpu_kernels, spec.batch_invariant, spec.block_size)
        logger.info("startup: model load %.3f s (kernels %.3f s)", time.perf_counter() - begun, self.kernels_s)
        weight_dtype = self.model.embed_tokens.weight.dtype
        if group is not None:
            apply_tp(self.model, group)
        is_fp32 = self.cpu_kernels is not None or weight_dtype == torch.uint8  # uint8: GGUF blocks
        self.dtype = torch.float32 if is_fp32 else weight_dtype  # activations, KV
        self.vocab_size = self.model.args.vocab_size
        self.states: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.fused: FusedForward | None = None  # built with the KV cache where it applies
        self.can_fuse_decode = self.cpu_kernels is not None and group is None
        # On the model's device: unseeded rows' noise is drawn there, not on the host and copied over.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(spec.seed), self.cpu_kernels)
        # After each decoder layer and each model step of a multi-step window: the core counts it as
        # progress, so a long window or prefill chunk on a busy CPU is not taken for a hung loop.
        self.on_progress = on_progress

    def _place(self, model: LlamaModel, can_use_kernels: bool) -> None:
        """Before the weights are read: the CPU kernels where they apply, and then the linear weights'
        place in one mapping collapsed into huge pages once loaded (streamed once a step: fewer TLB
        misses), so they are written once."""
        begun = time.perf_counter()
        weight_dtype = model.embed_tokens.weight.dtype
        kernel_dtypes = (torch.float32, torch.bfloat16, torch.uint8)  # uint8: blocks (worker/models/quantized.py)
        if can_use_kernels and self.device.type == "cpu" and weight_dtype in kernel_dtypes:
            self.cpu_kernels = load_cpu_kernels()
        self.kernels_s = time.perf_counter() - begun
        if self.cpu_kernels is not None:
            self.huge_page_memory = place_linear_weights(model, keep_values=False)

    def _stepped_lately(self) -> bool:
        return time.monotonic() - self.last_step_at < 0.25

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""

    @property
    def model_args(self):  # LlamaArgs (this rank's share of the heads under tensor parallelism)
        return self.model.args

    def bytes_per_block(self) -> int:
        a = self.model.args
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        begun = time.perf_counter()
        a = self.model.args
        shape = (2, a.num_kv_heads, num_blocks * self.block_size, a.head_dim)
        # Zero pages on the CPU, committed as blocks are first written (writing 2 GiB of zeros would
        # be a second of start-up); a cache larger than the machine's memory is refused by the mapping.
        caches = zero_page_tensors(a.num_layers, shape, self.dtype) if self.device.type == "cpu" else None
        self.kv_caches = caches or [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(a.num_layers)
        ]
        if self.can_fuse_decode:
            self.fused = FusedForward(self.cpu_kernels, self.model.weights(), self.kv_caches, a)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB); startup: KV cache %.3f s",
            num_blocks,
            self.block_size,
            num_blocks * self.bytes_per_block() / 2**20,
            time.perf_counter() - begun,
        )

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's final-normed hidden states [T, hidden], and the logits [R, vocab] of its sampled
        rows where the fused forward computed them too (None: compute_logits' to run): fused where it
        applies, else op by op."""
        wants_logits = inputs.sample_rows is None  # every row samples (a decode-only step)
        step = self.fused.step(inputs, wants_logits) if self.fused is not None else None
        if step is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn, self.on_progress)
            return hidden, None
        hidden = self.fused.run(step)
        if self.on_progress is not None:
            self.on_progress()
        return hidden, step.logits

    def _logits(self, hidden: torch.Tensor, fused_logits: torch.Tensor | None) -> torch.Tensor:
        """The sampled rows' logits: the fused forward's (the same products in C, the same numbers) or
        compute_logits'."""
        return fused_logits if fused_logits is not None else self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput([], np.zeros((0, 1), dtype=np.int32))
        self.last_step_at = time.monotonic()
        states = [self.states[req_id] for req_id in scheduler_output.num_scheduled_tokens]
        if scheduler_output.num_steps > 1:
            assert not scheduler_output.grammar_req_ids  # the scheduler cuts windows with a grammar row
            return self._execute_window(states, scheduler_output.num_steps)
        num_tokens = list(scheduler_output.num_scheduled_tokens.values())
        inputs = build_step_inputs(states, num_tokens, self.block_size, self.device)
        hidden, fused_logits = self.forward(inputs)
        for state, num in zip(states, num_tokens):
            state.num_computed_tokens += num
        sampling_states = [self.states[req_id] for req_id in inputs.sampled_req_ids]
        tensors = StepTensors()
        masses: dict[str, float] = {}
        if sampling_states:
            meta = build_sampling_metadata(sampling_states, self.vocab_size, self.device)
            meta.grammar = build_grammar_mask(
                scheduler_output.grammar_req_ids,
                scheduler_output.grammar_bitmask,
                inputs.sampled_req_ids,
                self.vocab_size,
                self.device,
            )
            sampled_hidden = hidden if inputs.sample_rows is None else hidden[inputs.sample_rows]
            logits = self._logits(sampled_hidden, fused_logits if inputs.sample_rows is None else None)
            out = self._agreed(self.sampler(logits, meta))
            tensors.add_step(out.sampled, _logprobs_of(out))
            masses = _constraint_masses(scheduler_output.grammar_req_ids, out, self.states)
        if self.group is None or self.group.rank == 0:  # prompt logprobs: rank 0's alone
            for job in inputs.prompt_jobs:
                params = self.states[job.req_id].params
                targets = torch.tensor(job.target_ids, dtype=torch.int64, device=self.device)
                candidates = candidate_ids(
                    params.prompt_logprob_token_ids, job.first_position, len(job.target_ids), self.device
                )
                rows = prompt_logprobs(
                    hidden[job.hidden_rows],
                    targets,
                    job.k,
                    self.model.compute_logits,
                    self.cpu_kernels,
                    candidates,
                    params.prompt_logprobs_temperature,
                )
                tensors.prompt_logprobs[job.req_id] = LogprobsTensors(*rows)
        host = tensors.to_host()
        for state, token_id in zip(sampling_states, host.sampled_token_ids[:, 0].tolist()):
            state.token_ids.append(token_id)
        output = host.runner_output([s.req_id for s in sampling_states], _logprob_req_ids(sampling_states))
        output.constraint_masses = masses
        return output

    def _execute_window(self, states: list[RequestState], num_steps: int) -> ModelRunnerOutput:
        """Decode-only multi-step: each step's sampled tokens feed the next on the device; tokens and
        logprobs of all steps come to the host in one copy at the end. Positions, slots and context
        lengths advance on the device; each request's token list holds placeholders until the end, so
        that seeds and min_tokens bans (per output position) advance exactly as with one step."""
        tensors = StepTensors()
        inputs = build_step_inputs(states, [1] * len(states), self.block_size, self.device)
        meta = build_sampling_metadata(states, self.vocab_size, self.device)
        for step in range(num_steps):
            hidden, fused_logits = self.forward(inputs)
            out = self._agreed(self.sampler(self._logits(hidden, fused_logits), meta))
            for state in states:
                state.num_computed_tokens += 1
                state.token_ids.append(_PLACEHOLDER)
            if self.on_progress is not None:  # a window's step, whichever path ran it
                self.on_progress()
            if step + 1 < num_steps:  # the next step's inputs, derived on the device from this one's
                inputs = next_window_step(inputs, out.sampled)
                advance_penalties(meta.penalties, out.sampled)
                meta = next_sampling_step(meta, states)
            tensors.add_step(out.sampled, _logprobs_of(out))
        host = tensors.to_host()  # sampled_token_ids [num_reqs, num_steps]
        for state, tokens in zip(states, host.sampled_token_ids.tolist()):
            state.token_ids[-num_steps:] = tokens
        return host.runner_output([s.req_id for s in states], _logprob_req_ids(states))

    def _agreed(self, out: SamplerOutput) -> SamplerOutput:
        """Tensor parallelism: every rank samples the same logits alike, and takes rank 0's tokens all
        the same, so that no rounding difference can ever make the ranks' sequences part."""
        if self.group is not None:
            self.group.broadcast_from_first(out.sampled)
        return out

    def _apply_diffs(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
        for data in scheduler_output.new_reqs:
            self.states[data.req_id] = RequestState.from_new(data)
        for data in scheduler_output.cached_reqs:
            state = self.states[data.req_id]
            state.add_blocks(data.new_block_ids)
            assert state.num_computed_tokens == data.num_computed_tokens, (
                data.req_id,
                state.num_computed_tokens,
            )


def _logprobs_of(out: SamplerOutput) -> LogprobsTensors | None:
    if out.logprobs is None:
        return None
    return LogprobsTensors(out.logprob_token_ids, out.logprobs, out.ranks)


def _constraint_masses(grammar_req_ids: list[str], out: SamplerOutput, states: dict) -> dict[str, float]:
    """The grammar rows' allowed mass, for those that asked for logprobs (a second small copy, only on
    steps with such a row)."""
    wanted = [row for row, r in enumerate(grammar_req_ids) if states[r].logprobs_k is not None]
    if not wanted or out.constraint_masses is None:
        return {}
    values = out.constraint_masses.cpu().tolist()
    return {grammar_req_ids[row]: values[row] for row in wanted}


def _logprob_req_ids(states: list[RequestState]) -> list[str]:
    return [s.req_id for s in states if s.logprobs_k is not None]
