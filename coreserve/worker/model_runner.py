"""ModelRunner: owns the model, the paged KV cache, the request states and the sampler; turns a
SchedulerOutput into a ModelRunnerOutput with one device-to-host copy per step (engine-core process).
It is the in-process `Executor` (coreserve/worker/executor.py), and each tensor-parallel rank's runner.

How the model runs here (kernels, huge pages, the attention plan, the fused decode step, the sampling
passes) is its `Backend`'s (coreserve/worker/backend.py), chosen once at load. Its parts, each owning what
it changes: the KV cache memory (`kv`, coreserve/worker/kv_memory.py), the LoRA adapters by slot (`lora`,
coreserve/worker/lora/slots.py), and the control verbs (`control`, coreserve/worker/runner_control.py: new
weights, sleep, wake, adapters loaded and dropped), the same on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from coreserve.protocol.step import ModelRunnerOutput, SchedulerOutput
from coreserve.worker import nan_empties
from coreserve.worker.backend import Backend, choose_backend
from coreserve.worker.kv_memory import KvMemory
from coreserve.worker.lora.slots import AdapterSlots
from coreserve.worker.models.loader import load_model
from coreserve.worker.models.sharding import Shard, apply_tp
from coreserve.worker.models.weight_store import WeightStore
from coreserve.worker.parallel.group import TensorParallelGroup
from coreserve.worker.pooling.pooler import Pooler, build_pooler
from coreserve.worker.runner_control import RunnerControl, call_verb
from coreserve.worker.sampling.grammar_mask import build_grammar_mask
from coreserve.worker.sampling.metadata import SamplingMetadata, build_sampling_metadata, next_sampling_step
from coreserve.worker.sampling.prompt_logprobs import prompt_logprob_rows
from coreserve.worker.sampling.sampler import Sampler, SamplerOutput, advance_penalties
from coreserve.worker.speculative.speculator import Speculator
from coreserve.worker.speculative.verification import Verification
from coreserve.worker.step.hidden_keep import HiddenKeep, hidden_keep, hidden_parts
from coreserve.worker.step.input_batch import RequestState, StepInputs, build_step_inputs, next_window_step
from coreserve.worker.step.runner_spec import RunnerSpec
from coreserve.worker.step.step_tensors import HostStep, StepExtras, StepTensors, logprob_req_ids
from coreserve.worker.step_extras import asks_extras, step_extras

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
        self.holds_nan_fill = False
        if spec.fill_empty_with_nan:  # given back by close(), or here when the start fails
            nan_empties.hold()
            self.holds_nan_fill = True
        try:
            self._start(spec, on_progress, group)
        except BaseException:
            self._release_nan_fill()
            raise

    def _start(
        self, spec: RunnerSpec, on_progress: Callable[[], None] | None, group: TensorParallelGroup | None
    ) -> None:
        self.device = pick_device(spec.device) if group is None else group.device
        self.block_size = spec.block_size
        self.group = group
        shard = None if group is None else Shard(group.rank, group.size)
        begun = time.perf_counter()
        self.backend: Backend = choose_backend(spec, self.device, is_sharded=group is not None)
        self.model = load_model(spec.model, spec.dtype, self.device, shard, self.backend.place, spec.check_tensors)
        self.last_step_at = 0.0  # time.monotonic() of the last step with tokens: the backend's collapse waits
        self.backend.adopt(self.model, is_busy=self._stepped_lately)
        if group is not None:
            apply_tp(self.model, group)
        logger.info("startup: model load %.3f s (%s backend)", time.perf_counter() - begun, self.backend.name)
        self.dtype = self.backend.activation_dtype(self.model.embed_tokens.weight.dtype)  # activations, KV
        # runner="pooling": each prompt's hidden states pooled instead of sampled (coreserve/worker/pooling/)
        self.pooler: Pooler | None = build_pooler(spec.runner, spec.model, self.model.args, self.device)
        if self.pooler is not None and (group is not None or spec.speculative is not None or self.model.args.is_hybrid):
            raise ValueError("runner='pooling' with tensor_parallel_size > 1, speculative decoding or a hybrid model "
                             "(recurrent layers) is not built")
        self.pooling = None if self.pooler is None else self.pooler.spec.facts  # the handshake's
        self.vocab_size = self.model.args.vocab_size
        self.states: dict[str, RequestState] = {}
        self.asking_extras: set[str] = set()  # live requests that ask for a step extra (coreserve/worker/step_extras.py)
        # On the model's device: unseeded rows' noise is drawn there, not on the host and copied over.
        generator = torch.Generator(device=self.device).manual_seed(spec.seed)
        self.sampler = Sampler(generator, self.backend.sampling)
        # After each decoder layer and each model step of a multi-step window: the core counts it as
        # progress, so a long window or prefill chunk on a busy CPU is not taken for a hung loop.
        self.on_progress = on_progress
        # Speculative decoding (coreserve/worker/speculative/); None: no speculation
        self.speculator = Speculator.build(spec, self.vocab_size, ModelRunner)
        proposer = None if self.speculator is None else self.speculator.proposer
        self.kv = KvMemory(self.backend, self.model, self.block_size, self.dtype, self.device, proposer)
        # LoRA (coreserve/worker/lora/): the loaded adapters by slot, their deltas added by the model's ops
        self.lora: AdapterSlots | None = None
        if spec.enable_lora:
            self.lora = AdapterSlots(self.model, spec.max_lora_rank, shard, self.backend.lora_products())
        weights = WeightStore(self.model, shard, spec.check_tensors)
        self.control = RunnerControl(weights, self.kv, self.lora, self.backend.renew_weight_memory, self._mark_busy)

    def _stepped_lately(self) -> bool:
        return time.monotonic() - self.last_step_at < 0.25

    def _mark_busy(self) -> None:
        self.last_step_at = time.monotonic()

    def collective_rpc(self, verb: str, kwargs: dict) -> list:
        """The in-process Executor's: the control verb run on this runner, its result as the one rank's."""
        return [call_verb(self.control, verb, kwargs)]

    def close(self) -> None:
        """The model lives in this process: only what runs beside the steps stops (the huge-page
        collapse, which would hold the weights seconds after an in-process engine closed)."""
        self.backend.close()
        self._release_nan_fill()

    def _release_nan_fill(self) -> None:
        if self.holds_nan_fill:
            self.holds_nan_fill = False
            nan_empties.release()

    @property
    def model_args(self):  # DecoderArgs (this rank's share of the heads under tensor parallelism)
        return self.model.args

    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block()

    def host_kv_bytes(self, num_blocks: int) -> int:
        return self.kv.host_kv_bytes(num_blocks)

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0, num_snapshot_slots: int = 0) -> None:
        self.kv.allocate(num_blocks, num_state_slots, num_snapshot_slots)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, on the threads the backend gives it (fewer while the host is shared)."""
        with self.backend.step_threads():
            output = self._step(scheduler_output)
        for req_id, snapshot in scheduler_output.state_snapshots.items():  # a hybrid's, at a chain's boundary
            self.kv.save_snapshot(self.states[req_id].state_slot, snapshot)
        return output

    def _step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The forward of every scheduled token, then the sampled rows and the prompt logprob rows of the
        requests that ask; a step that verifies proposals is `_verified_step`'s, a multi-step window
        `_execute_window`'s."""
        self._apply_diffs(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput([], np.zeros((0, 1), dtype=np.int32))
        self._mark_busy()
        states = [self.states[req_id] for req_id in scheduler_output.num_scheduled_tokens]
        if scheduler_output.num_steps > 1:
            assert not scheduler_output.grammar_req_ids  # the scheduler cuts windows with a grammar row
            return self._execute_window(states, scheduler_output.num_steps)
        num_tokens = list(scheduler_output.num_scheduled_tokens.values())
        verification = None if self.speculator is None else self.speculator.propose(states, num_tokens, scheduler_output)
        if verification is not None:
            return self._verified_step(scheduler_output, states, num_tokens, verification)
        inputs = self.prepare(states, num_tokens)
        sampling_states = [self.states[req_id] for req_id in inputs.sampled_req_ids]
        host, _, extras = self._forward_rows(scheduler_output, states, num_tokens, inputs, sampling_states)
        for state, token_id in zip(sampling_states, host.sampled_token_ids[:, 0].tolist()):
            state.token_ids.append(token_id)
        return host.runner_output([s.req_id for s in sampling_states], logprob_req_ids(sampling_states), extras)

    def _verified_step(
        self, scheduler_output: SchedulerOutput, states: list[RequestState], num_tokens: list[int],
        verification: Verification,
    ) -> ModelRunnerOutput:
        """A step that verifies proposals (coreserve/worker/speculative/verification.py): each verified position a
        sampled decode row, sampled as decoding it alone would be; the speculator keeps the tokens the
        samples agree with, and the step's output is its."""
        inputs = self.prepare(states, num_tokens, verification.req_ids)
        row_ids = inputs.sampled_req_ids  # a verified request has a row a position
        row_states = verification.row_states(states, row_ids)
        host, out, extras = self._forward_rows(scheduler_output, states, num_tokens, inputs, row_states, False)
        sampled = [self.states[req_id] for req_id in dict.fromkeys(row_ids)]
        return self.speculator.verified(verification, sampled, row_ids, out, host.prompt_logprobs, extras)

    def _forward_rows(
        self, scheduler_output: SchedulerOutput, states: list[RequestState], num_tokens: list[int],
        inputs: StepInputs, sampling_states: list[RequestState], keep_rows: bool = True,
    ) -> tuple[HostStep, SamplerOutput | None, StepExtras | None]:
        """The forward, then its sampled rows (`sampling_states`, a state a row) and prompt logprob rows,
        in one copy to the host (`keep_rows` False: the sampled rows are a verification's, which the
        speculator copies); the step's extras where a request asks. Returns (the host tensors, the
        sampler's output or None, the extras or None); the states' computed tokens advance."""
        meta = self._sampling_metadata(scheduler_output, inputs, sampling_states) if sampling_states else None
        keep = self._hidden_keep(states, num_tokens)
        hidden, out = self.forward_and_sample(inputs, meta, keep=keep)
        pooled = self.pooler.pool(self.model, hidden, inputs.pool_jobs) if inputs.pool_jobs else {}
        extras = None
        if self.asking_extras:  # before the computed tokens advance: the routed rows' positions
            grammars = scheduler_output.grammar_req_ids
            extras = step_extras(self.model, states, num_tokens, sampling_states, out, grammars, self.states)
            if keep is not None:
                extras.hidden_states = hidden_parts(keep, self.model.kept_states, hidden)
        for state, num in zip(states, num_tokens):
            state.num_computed_tokens += num
        tensors = StepTensors()
        if keep_rows and out is not None:
            tensors.add_step(out.sampled, out.logprobs)
        if inputs.prompt_jobs and (self.group is None or self.group.rank == 0):  # rank 0's alone
            logits_of, ops = self._prompt_logits, self.backend.sampling
            if self.lora is None:
                tensors.prompt_logprobs = prompt_logprob_rows(inputs.prompt_jobs, self.states, hidden, logits_of, ops)
            else:  # a job's rows are one request's: its adapter for every row of each slice
                tensors.prompt_logprobs = {}
                for job in inputs.prompt_jobs:
                    self.lora.use_slot(self.states[job.req_id].lora_slot)
                    tensors.prompt_logprobs.update(prompt_logprob_rows([job], self.states, hidden, logits_of, ops))
        host = tensors.to_host()
        host.pooled = pooled
        return host, out, extras

    def _prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits of one prompt-logprobs slice, reported as progress: a step's slices pass no layer, and
        over a large vocabulary each takes seconds (gpt-oss's 201,088 rows: 148 G multiply-adds a slice)."""
        logits = self.model.compute_logits(hidden)
        if self.on_progress is not None:
            self.on_progress()
        return logits

    def prepare(
        self, states: list[RequestState], num_tokens: list[int], verified: frozenset[str] = frozenset()
    ) -> StepInputs:
        """The step's flattened inputs (`verified`: requests whose every token is a sampled decode row),
        with the backend's attention plan made before the forward."""
        long_rows_start = self.model.rotary.long_rows_start
        inputs = build_step_inputs(states, num_tokens, self.block_size, self.device, verified, long_rows_start)
        if self.lora is not None:
            inputs.lora_rows = self.lora.token_rows([s.lora_slot for s in states], num_tokens)
        self.backend.prepare(inputs.attn)
        return inputs

    def forward_and_sample(
        self, inputs: StepInputs, meta: SamplingMetadata | None, rows: torch.Tensor | None = None,
        keep: HiddenKeep | None = None,
    ) -> tuple[torch.Tensor, SamplerOutput | None]:
        """The forward of `inputs` (`prepare`'s), then its sampled rows' tokens and logprob rows under
        `meta` (`rows`: only these of the sampled rows; meta None: none samples), every rank taking rank
        0's tokens. Returns the hidden states too, for prompt logprobs; `keep`: the layers' states the
        model keeps (return_hidden_states). A step's, a multi-step window's and a draft model's
        (coreserve/worker/speculative/draft_model.py) one way to run the model."""
        if self.lora is not None:
            self.lora.use_rows(inputs.lora_rows)
        hidden, fused_logits = self.backend.forward(self.model, inputs, self.kv.caches, self.on_progress, keep)
        if meta is None:
            return hidden, None
        if self.lora is not None:  # a row a sampled request
            slots = [self.states[req_id].lora_slot for req_id in inputs.sampled_req_ids]
            self.lora.use_rows(self.lora.token_rows(slots, [1] * len(slots)))
        logits = self._logits(inputs, hidden, fused_logits)
        if rows is not None:
            logits = logits[rows]
        return hidden, self._agreed(self.sampler(logits, meta))

    def _logits(
        self, inputs: StepInputs, hidden: torch.Tensor, fused_logits: torch.Tensor | None
    ) -> torch.Tensor:
        """The sampled rows' logits [R, vocab]: the fused forward's where every row samples (the same
        products in C, the same numbers), else compute_logits' of those rows."""
        if inputs.sample_rows is not None:
            return self.model.compute_logits(hidden[inputs.sample_rows])
        return fused_logits if fused_logits is not None else self.model.compute_logits(hidden)

    def _sampling_metadata(
        self, scheduler_output: SchedulerOutput, inputs: StepInputs, states: list[RequestState]
    ) -> SamplingMetadata:
        """The sampled rows' (`states`) parameters, under their grammars' masks where a row has one."""
        meta = build_sampling_metadata(states, self.vocab_size, self.device)
        if scheduler_output.grammar_req_ids:
            meta.grammar = build_grammar_mask(
                scheduler_output.grammar_req_ids,
                scheduler_output.grammar_bitmask,
                inputs.sampled_req_ids,
                self.vocab_size,
                self.device,
            )
        return meta

    def _execute_window(self, states: list[RequestState], num_steps: int) -> ModelRunnerOutput:
        """Decode-only multi-step: each step's sampled tokens feed the next on the device; tokens and
        logprobs of all steps come to the host in one copy at the end. Positions, slots and context
        lengths advance on the device; each request's token list holds placeholders until the end, so
        that seeds and min_tokens bans (per output position) advance exactly as with one step."""
        tensors, extras = StepTensors(), StepExtras() if self.asking_extras else None
        inputs = self.prepare(states, [1] * len(states))
        meta = build_sampling_metadata(states, self.vocab_size, self.device)
        for step in range(num_steps):
            keep = self._hidden_keep(states, [1] * len(states))
            hidden, out = self.forward_and_sample(inputs, meta, keep=keep)
            if extras is not None:
                later = step_extras(self.model, states, [1] * len(states), states, out, [], self.states)
                if keep is not None:
                    later.hidden_states = hidden_parts(keep, self.model.kept_states, hidden)
                extras.merge(later)
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
        return host.runner_output([s.req_id for s in states], logprob_req_ids(states), extras)

    def _hidden_keep(self, states: list[RequestState], num_tokens: list[int]) -> HiddenKeep | None:
        """The hidden states the step's forward keeps, where a request asks (return_hidden_states)."""
        if not self.asking_extras:
            return None
        return hidden_keep(states, num_tokens, self.model.args.num_layers, self.device)

    def _agreed(self, out: SamplerOutput) -> SamplerOutput:
        """Tensor parallelism: every rank samples the same logits alike, and takes rank 0's tokens all
        the same, so that no rounding difference can ever make the ranks' sequences part."""
        if self.group is not None:
            self.group.broadcast_from_first(out.sampled)
        return out

    def _apply_diffs(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            gone = self.states.pop(req_id, None)
            if gone is not None and gone.state_slot >= 0:
                self.kv.give_state_slot(gone.state_slot)
            self.asking_extras.discard(req_id)
            if self.speculator is not None:
                self.speculator.proposer.forget(req_id)
        for data in scheduler_output.new_reqs:
            self.states[data.req_id] = state = RequestState.from_new(data)
            if self.kv.num_state_slots:  # a hybrid's state: from zeros, or its cached prefix's snapshot
                assert (state.num_computed_tokens == 0) == (data.state_snapshot < 0), "a prefix without its state"
                state.state_slot = self.kv.take_state_slot(data.state_snapshot)
            if asks_extras(state):
                self.asking_extras.add(data.req_id)
            if self.speculator is not None:
                self.speculator.adopt(state)
        for data in scheduler_output.cached_reqs:
            state = self.states[data.req_id]
            state.add_blocks(data.new_block_ids)
            assert state.num_computed_tokens == data.num_computed_tokens, (
                data.req_id,
                state.num_computed_tokens,
            )
