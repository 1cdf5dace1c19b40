"""ModelRunner: owns the model, the paged KV cache and the sampler; turns a SchedulerOutput into a
ModelRunnerOutput with one device-to-host copy per step (engine-core process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from protocol.step import HostLogprobs, ModelRunnerOutput, SchedulerOutput
from worker.cpu.huge_pages import move_linear_weights_to_huge_pages
from worker.cpu.kernels import load_cpu_kernels
from worker.input_batch import RequestState, build_step_inputs, next_window_step
from worker.logprobs import copy_to_host, prompt_logprobs
from worker.models.loader import load_model
from worker.parallel.group import TensorParallelGroup
from worker.parallel.sharding import Shard
from worker.sampler import Sampler, SamplerOutput, advance_penalties
from worker.sampling_metadata import build_sampling_metadata, next_sampling_step

logger = logging.getLogger(__name__)

_PLACEHOLDER = -1  # a token sampled on the device whose value the host has not seen yet


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        dtype: str,
        device: str,
        block_size: int,
        seed: int,
        can_use_cpu_kernels: bool = True,
        group: TensorParallelGroup | None = None,
    ) -> None:
        self.device = pick_device(device) if group is None else group.device
        self.block_size = block_size
        # Tensor parallelism: this rank's heads and MLP columns; each layer half ends in a sum over ranks.
        self.group = group
        shard = None if group is None else Shard(group.rank, group.size)
        self.model = load_model(model_dir, dtype, self.device, shard)  # dtype "auto": the checkpoint's
        if group is not None:
            for layer in self.model.layers:
                layer.all_reduce = group.all_reduce
        self.vocab_size = self.model.args.vocab_size
        self.states: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        # C kernels on the CPU for fp32 and bf16 weights, with fp32 activations and KV cache
        # (docs/decisions.md); torch's ops in the weights' dtype elsewhere, or without a compiler.
        weight_dtype = self.model.embed_tokens.weight.dtype
        can_use = self.device.type == "cpu" and weight_dtype in (torch.float32, torch.bfloat16)
        self.cpu_kernels = load_cpu_kernels() if can_use and can_use_cpu_kernels else None
        if self.cpu_kernels is not None:
            self.model.use_cpu_kernels(self.cpu_kernels)
            move_linear_weights_to_huge_pages(self.model)  # streamed once a step: fewer TLB misses
        self.dtype = torch.float32 if self.cpu_kernels is not None else weight_dtype  # activations, KV
        # On the model's device: unseeded rows' noise is drawn there, not on the host and copied over.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed), self.cpu_kernels)
        # Called after each decoder layer and each model step of a multi-step window: the core server
        # counts it as progress, so a long window or a long prefill chunk on a busy CPU is not taken
        # for a hung loop (a forward that stops moving still is).
        self.on_progress: Callable[[], None] | None = None
        self.model.on_layer = self._mark_progress  # a plain call, not a module hook (nn.Module's slow path)

    def close(self) -> None:
        """Nothing to stop: the model lives in this process (TensorParallelRunner's has workers)."""

    @property
    def model_args(self):  # LlamaArgs (this rank's share of the heads under tensor parallelism)
        return self.model.args

    def _mark_progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress()

    def bytes_per_block(self) -> int:
        a = self.model.args
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        a = self.model.args
        shape = (2, a.num_kv_heads, num_blocks * self.block_size, a.head_dim)
        # Zeroed, so the memory is committed now: a cache too large fails at start, not mid-run.
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(a.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.bytes_per_block() / 2**20,
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput([], np.zeros((0, 1), dtype=np.int32))
        states = [self.states[req_id] for req_id in scheduler_output.num_scheduled_tokens]
        if scheduler_output.num_steps > 1:
            return self._execute_window(states, scheduler_output.num_steps)
        inputs = build_step_inputs(
            states,
            list(scheduler_output.num_scheduled_tokens.values()),
            self.block_size,
            self.device,
            self.cpu_kernels,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        for state, num in zip(states, scheduler_output.num_scheduled_tokens.values()):
            state.num_computed_tokens += num
        sampling_states = [self.states[req_id] for req_id in inputs.sampled_req_ids]
        device_tensors, logprob_req_ids = [], []
        if sampling_states:
            meta = build_sampling_metadata(sampling_states, self.vocab_size, self.device)
            sampled_hidden = hidden if inputs.sample_rows is None else hidden[inputs.sample_rows]
            out = self._agreed(self.sampler(self.model.compute_logits(sampled_hidden), meta))
            device_tensors.append(out.sampled.unsqueeze(1))
            if out.logprobs is not None:
                device_tensors += [out.logprob_token_ids, out.logprobs, out.ranks]
                logprob_req_ids = [s.req_id for s in sampling_states if s.logprobs_k is not None]
        prompt_jobs = inputs.prompt_jobs if self.group is None or self.group.rank == 0 else []  # rank 0's
        for job in prompt_jobs:
            targets = torch.tensor(job.target_ids, dtype=torch.int64, device=self.device)
            device_tensors += prompt_logprobs(
                hidden[job.hidden_rows], targets, job.k, self.model.compute_logits, self.cpu_kernels
            )
        host = copy_to_host(device_tensors)
        sampled = host.pop(0) if sampling_states else np.zeros((0, 1), dtype=np.int32)
        output = self._sampled_output(sampling_states, sampled, logprob_req_ids, host, num_steps=1)
        for i, job in enumerate(prompt_jobs):
            output.prompt_logprobs[job.req_id] = HostLogprobs(*host[3 * i : 3 * i + 3])
        return output

    def _execute_window(self, states: list[RequestState], num_steps: int) -> ModelRunnerOutput:
        """Decode-only multi-step: each step's sampled tokens feed the next on the device; tokens and
        logprobs of all steps come to the host in one copy at the end. Positions, slots and context
        lengths advance on the device; each request's token list holds placeholders until the end, so
        that seeds and min_tokens bans (per output position) advance exactly as with one step."""
        sampled_steps, device_tensors = [], []
        has_logprobs = any(s.logprobs_k is not None for s in states)
        inputs = build_step_inputs(states, [1] * len(states), self.block_size, self.device, self.cpu_kernels)
        meta = build_sampling_metadata(states, self.vocab_size, self.device)
        for step in range(num_steps):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
            out = self._agreed(self.sampler(self.model.compute_logits(hidden), meta))
            for state in states:
                state.num_computed_tokens += 1
                state.token_ids.append(_PLACEHOLDER)
            if self.on_progress is not None:
                self.on_progress()
            if step + 1 < num_steps:  # the next step's inputs, derived on the device from this one's
                inputs = next_window_step(inputs, out.sampled)
                advance_penalties(meta.penalties, out.sampled)
                meta = next_sampling_step(meta, states)
            sampled_steps.append(out.sampled)
            if has_logprobs:
                device_tensors += [out.logprob_token_ids, out.logprobs, out.ranks]
        host = copy_to_host([torch.stack(sampled_steps, dim=1), *device_tensors])
        sampled = host.pop(0)  # [num_reqs, num_steps]
        for state, tokens in zip(states, sampled.tolist()):
            state.token_ids[-num_steps:] = tokens
            state.token_ids.pop()  # _sampled_output appends the last one, as after a single step
        logprob_req_ids = [s.req_id for s in states if s.logprobs_k is not None]
        return self._sampled_output(states, sampled, logprob_req_ids, host, num_steps)

    def _agreed(self, out: SamplerOutput) -> SamplerOutput:
        """Tensor parallelism: every rank samples the same logits alike, and takes rank 0's tokens all
        the same, so that no rounding difference can ever make the ranks' sequences part."""
        if self.group is not None:
            self.group.broadcast_from_first(out.sampled)
        return out

    def _sampled_output(self, states, sampled: np.ndarray, logprob_req_ids, host: list, num_steps: int):
        """Appends each request's last sampled token and packs the runner output; consumes the
        logprob arrays (three per step) from the front of `host`."""
        for state, token_id in zip(states, sampled[:, -1].tolist()):
            state.token_ids.append(token_id)
        output = ModelRunnerOutput([s.req_id for s in states], sampled, logprob_req_ids)
        if logprob_req_ids:
            for _ in range(num_steps):
                output.logprobs.append(HostLogprobs(*host[:3]))
                del host[:3]
        return output

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
