"""ModelRunner: owns the model, the paged KV cache, the request states and the sampler; turns a
SchedulerOutput into a ModelRunnerOutput with one device-to-host copy per step (engine-core process).
It is the in-process `Executor` (worker/executor.py), and each tensor-parallel rank's runner.

How the model runs here (kernels, huge pages, the attention plan, the fused decode step, the sampling
passes) is its `Backend`'s (worker/backend.py), chosen once at load. The control verbs (new weights,
sleep, wake) are plain methods, the same on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from protocol.step import ModelRunnerOutput, SchedulerOutput
from worker.backend import Backend, choose_backend
from worker.input_batch import RequestState, StepInputs, build_step_inputs, next_window_step
from worker.models.loader import load_model
from worker.models.weight_store import WeightStore
from worker.parallel.group import TensorParallelGroup
from worker.parallel.sharding import Shard, apply_tp
from worker.routed_experts import merge, routed_rows
from worker.runner_spec import RunnerSpec
from worker.sampling.grammar_mask import build_grammar_mask
from worker.sampling.metadata import build_sampling_metadata, next_sampling_step
from worker.sampling.prompt_logprobs import candidate_ids, prompt_logprobs
from worker.sampling.sampler import Sampler, SamplerOutput, advance_penalties
from worker.sampling.supports import sampling_masks
from worker.speculative.speculator import Speculator
from worker.speculative.verification import Verification
from worker.step_tensors import LogprobsTensors, StepTensors, constraint_masses, logprob_req_ids

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
        self.backend: Backend = choose_backend(spec, self.device, is_sharded=group is not None)
        self.model = load_model(spec.model, spec.dtype, self.device, shard, self.backend.place)
        self.last_step_at = 0.0  # time.monotonic() of the last step with tokens: the backend's collapse waits
        self.backend.adopt(self.model, is_busy=self._stepped_lately)
        if group is not None:
            apply_tp(self.model, group)
        logger.info("startup: model load %.3f s (%s backend)", time.perf_counter() - begun, self.backend.name)
        self.dtype = self.backend.activation_dtype(self.model.embed_tokens.weight.dtype)  # activations, KV
        self.vocab_size = self.model.args.vocab_size
        self.weights = WeightStore(self.model, shard)
        self.states: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0  # what the KV cache holds (kept through a sleep, for the wake)
        # On the model's device: unseeded rows' noise is drawn there, not on the host and copied over.
        generator = torch.Generator(device=self.device).manual_seed(spec.seed)
        self.sampler = Sampler(generator, self.backend.sampling)
        # After each decoder layer and each model step of a multi-step window: the core counts it as
        # progress, so a long window or prefill chunk on a busy CPU is not taken for a hung loop.
        self.on_progress = on_progress
        # Speculative decoding (worker/speculative/); None: no speculation
        self.speculator = Speculator.build(spec, self.vocab_size, ModelRunner)

    def _stepped_lately(self) -> bool:
        return time.monotonic() - self.last_step_at < 0.25

    def close(self) -> None:
        """The model lives in this process: only what runs beside the steps stops (the huge-page
        collapse, which would hold the weights seconds after an in-process engine closed)."""
        self.backend.close()

    @property
    def model_args(self):  # LlamaArgs (this rank's share of the heads under tensor parallelism)
        return self.model.args

    def bytes_per_block(self) -> int:
        a = self.model.args
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def host_kv_bytes(self, num_blocks: int) -> int:
        """The host memory a KV cache of num_blocks takes (a draft model's too): all of it on the CPU,
        none on a GPU."""
        draft = 0 if self.speculator is None else self.speculator.proposer.host_kv_bytes(num_blocks)
        return (num_blocks * self.bytes_per_block() if self.device.type == "cpu" else 0) + draft

    def allocate_kv_cache(self, num_blocks: int) -> None:
        begun = time.perf_counter()
        a = self.model.args
        shape = (2, a.num_kv_heads, num_blocks * self.block_size, a.head_dim)
        self.kv_caches = self.backend.allocate_kv_cache(a.num_layers, shape, self.dtype)
        self.num_kv_blocks = num_blocks
        self.backend.bind(self.model, self.kv_caches)
        if self.speculator is not None:
            self.speculator.proposer.allocate_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB); startup: KV cache %.3f s",
            num_blocks,
            self.block_size,
            num_blocks * self.bytes_per_block() / 2**20,
            time.perf_counter() - begun,
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, on the threads the backend gives it (fewer while the host is shared)."""
        with self.backend.step_threads():
            return self._step(scheduler_output)

    def _step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The forward of every scheduled token, then the sampled rows and the prompt logprob rows of the
        requests that ask (a multi-step window runs its steps in `_execute_window`)."""
        self._apply_diffs(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput([], np.zeros((0, 1), dtype=np.int32))
        self.last_step_at = time.monotonic()
        states = [self.states[req_id] for req_id in scheduler_output.num_scheduled_tokens]
        if scheduler_output.num_steps > 1:
            assert not scheduler_output.grammar_req_ids  # the scheduler cuts windows with a grammar row
            return self._execute_window(states, scheduler_output.num_steps)
        num_tokens = list(scheduler_output.num_scheduled_tokens.values())
        verification = None if self.speculator is None else self.speculator.propose(states, num_tokens, scheduler_output)
        inputs = self._prepare(states, num_tokens, verification)
        hidden, fused_logits = self.backend.forward(self.model, inputs, self.kv_caches, self.on_progress)
        routed = routed_rows(self.model, states, num_tokens)
        for state, num in zip(states, num_tokens):
            state.num_computed_tokens += num
        if verification is not None:  # a state per sampled row: a verified request has several
            sampling_states = verification.row_states(states, inputs.sampled_req_ids)
        else:
            sampling_states = [self.states[req_id] for req_id in inputs.sampled_req_ids]
        out, masses, host = self._sample_rows(scheduler_output, inputs, sampling_states, hidden, fused_logits,
                                              keep_rows=verification is None)
        masks = sampling_masks(sampling_states, out)
        output = self._step_output(verification, inputs, sampling_states, out, masses, host)
        output.routed_experts, output.sampling_masks = routed, masks
        return output

    def _step_output(self, verification: Verification | None, inputs: StepInputs, sampling_states: list,
                     out, masses: dict, host) -> ModelRunnerOutput:
        """The step's output: the speculator's where it verified proposals (the tokens it accepted), else
        each sampled row's token appended to its request and the rows as they came to the host."""
        if verification is not None:
            sampled = [self.states[req_id] for req_id in dict.fromkeys(inputs.sampled_req_ids)]
            output = self.speculator.verified(
                verification, sampled, inputs.sampled_req_ids, out, logprob_req_ids(sampled), masses
            )
            output.prompt_logprobs = host.prompt_logprobs
            return output
        for state, token_id in zip(sampling_states, host.sampled_token_ids[:, 0].tolist()):
            state.token_ids.append(token_id)
        output = host.runner_output([s.req_id for s in sampling_states], logprob_req_ids(sampling_states))
        output.constraint_masses = masses
        return output

    def _sample_rows(self, scheduler_output: SchedulerOutput, inputs: StepInputs, sampling_states: list,
                     hidden: torch.Tensor, fused_logits: torch.Tensor | None, keep_rows: bool):
        """Samples the rows that sample and computes the prompt logprob rows, brought to the host in one
        copy; `keep_rows` False: the sampled rows are a verification's, which the speculator keeps.
        Returns (the sampler's output or None, constraint masses, the host tensors)."""
        tensors, masses, out = StepTensors(), {}, None
        if sampling_states:
            logits = self._logits(inputs, hidden, fused_logits)
            out = self._sample(scheduler_output, inputs, sampling_states, logits)
            if keep_rows:
                tensors.add_step(out.sampled, out.logprobs)
            masses = constraint_masses(scheduler_output.grammar_req_ids, out, self.states)
        if self.group is None or self.group.rank == 0:  # prompt logprobs: rank 0's alone
            tensors.prompt_logprobs.update(self._prompt_logprobs(inputs, hidden))
        return out, masses, tensors.to_host()

    def _prepare(
        self, states: list[RequestState], num_tokens: list[int], verification: Verification | None = None
    ) -> StepInputs:
        """The step's flattened inputs, with the backend's attention plan made before the forward."""
        verified = frozenset() if verification is None else verification.req_ids
        long_rows_start = self.model.rotary.long_rows_start
        inputs = build_step_inputs(states, num_tokens, self.block_size, self.device, verified, long_rows_start)
        self.backend.prepare(inputs.attn)
        return inputs

    def _logits(
        self, inputs: StepInputs, hidden: torch.Tensor, fused_logits: torch.Tensor | None
    ) -> torch.Tensor:
        """The sampled rows' logits [R, vocab]: the fused forward's where every row samples (the same
        products in C, the same numbers), else compute_logits' of those rows."""
        if inputs.sample_rows is not None:
            return self.model.compute_logits(hidden[inputs.sample_rows])
        return fused_logits if fused_logits is not None else self.model.compute_logits(hidden)

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        states: list[RequestState],
        logits: torch.Tensor,
    ) -> SamplerOutput:
        """The sampled rows' (`states`) tokens and logprob rows, under their grammars' masks."""
        meta = build_sampling_metadata(states, self.vocab_size, self.device)
        meta.grammar = build_grammar_mask(
            scheduler_output.grammar_req_ids,
            scheduler_output.grammar_bitmask,
            inputs.sampled_req_ids,
            self.vocab_size,
            self.device,
        )
        return self._agreed(self.sampler(logits, meta))

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, LogprobsTensors]:
        rows = {}
        for job in inputs.prompt_jobs:
            params = self.states[job.req_id].params
            targets = torch.tensor(job.target_ids, dtype=torch.int64, device=self.device)
            candidates = candidate_ids(
                params.prompt_logprob_token_ids, job.first_position, len(job.target_ids), self.device
            )
            triple = prompt_logprobs(
                hidden[job.hidden_rows],
                targets,
                job.k,
                self.model.compute_logits,
                self.backend.sampling,
                candidates,
                params.prompt_logprobs_temperature,
            )
            rows[job.req_id] = LogprobsTensors(*triple)
        return rows

    def _execute_window(self, states: list[RequestState], num_steps: int) -> ModelRunnerOutput:
        """Decode-only multi-step: each step's sampled tokens feed the next on the device; tokens and
        logprobs of all steps come to the host in one copy at the end. Positions, slots and context
        lengths advance on the device; each request's token list holds placeholders until the end, so
        that seeds and min_tokens bans (per output position) advance exactly as with one step."""
        tensors, routed, masks = StepTensors(), {}, {}
        inputs = self._prepare(states, [1] * len(states))
        meta = build_sampling_metadata(states, self.vocab_size, self.device)
        for step in range(num_steps):
            hidden, fused_logits = self.backend.forward(self.model, inputs, self.kv_caches, self.on_progress)
            out = self._agreed(self.sampler(self._logits(inputs, hidden, fused_logits), meta))
            merge(routed, routed_rows(self.model, states, [1] * len(states)))
            merge(masks, sampling_masks(states, out))
            for state in states:
                state.num_computed_tokens += 1
                state.token_ids.append(_PLACEHOLDER)
            if self.on_progress is not None:  # a window's step, whichever path ran it
                self.on_progress()
            if step + 1 < num_steps:  # the next step's inputs, derived on the device from this one's
                inputs = next_window_step(inputs, out.sampled)
                advance_penalties(meta.penalties, out.sampled)
                meta = next_sampling_step(meta, states)
            tensors.add_step(out.sampled, out.logprobs)
        host = tensors.to_host()  # sampled_token_ids [num_reqs, num_steps]
        for state, tokens in zip(states, host.sampled_token_ids.tolist()):
            state.token_ids[-num_steps:] = tokens
        output = host.runner_output([s.req_id for s in states], logprob_req_ids(states))
        output.routed_experts, output.sampling_masks = routed, masks
        return output

    def _agreed(self, out: SamplerOutput) -> SamplerOutput:
        """Tensor parallelism: every rank samples the same logits alike, and takes rank 0's tokens all
        the same, so that no rounding difference can ever make the ranks' sequences part."""
        if self.group is not None:
            self.group.broadcast_from_first(out.sampled)
        return out

    def _apply_diffs(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
            if self.speculator is not None:
                self.speculator.proposer.forget(req_id)
        for data in scheduler_output.new_reqs:
            self.states[data.req_id] = state = RequestState.from_new(data)
            if self.speculator is not None:
                self.speculator.adopt(state)
        for data in scheduler_output.cached_reqs:
            state = self.states[data.req_id]
            state.add_blocks(data.new_block_ids)
            assert state.num_computed_tokens == data.num_computed_tokens, (
                data.req_id,
                state.num_computed_tokens,
            )

    # Control verbs (the Executor protocol's): between steps, never during one.

    def check_weights(self, path: str) -> None:
        self.weights.check(path)

    def update_weights(self, path: str) -> dict[str, float]:
        """New weights in place, every tensor checked before any is copied (a ValueError leaves the old
        ones serving); what the backend derived from their addresses rebuilt. Returns the phases (load:
        checks and copies; derive), seconds."""
        begun = time.perf_counter()
        self.last_step_at = time.monotonic()  # the huge-page collapse waits, as on a step
        count = self.weights.update(path, self.backend.renew_weight_memory)
        loaded = time.perf_counter()
        if self.kv_caches:
            self.backend.bind(self.model, self.kv_caches)
        timings = {"load": loaded - begun, "derive": time.perf_counter() - loaded}
        logger.info("update_weights: %d tensors in %.3f s", count, time.perf_counter() - begun)
        self.last_step_at = time.monotonic()
        return timings

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (the core's block pool restarts empty on wake); level 2 drops the
        weights too, keeping their shapes."""
        self.backend.release()
        self.kv_caches = []
        if self.speculator is not None:
            self.speculator.proposer.release()
        if level >= 2 and not self.weights.is_dropped:
            self.weights.drop()

    def wake_up(self, kv_cache: bool, path: str | None) -> None:
        """`path`: the checkpoint the dropped weights come back from (required after level 2)."""
        if path is not None:
            self.update_weights(path)
        elif self.weights.is_dropped:
            raise ValueError(
                "the weights were dropped (sleep level 2): wake up with a checkpoint path, "
                "or call update_weights with the whole state"
            )
        if kv_cache and not self.kv_caches and self.num_kv_blocks:
            self.allocate_kv_cache(self.num_kv_blocks)  # zeroed; the backend binds to it again

