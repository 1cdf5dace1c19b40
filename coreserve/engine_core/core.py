"""EngineCore: the executor (the model) and the scheduler, driven one step at a time (engine-core process).

It knows nothing of sockets; the server (or the in-process client) feeds it requests and takes outputs.
The model is behind an `Executor` (coreserve/worker/executor.py): in this process or over tensor-parallel ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coreserve.engine_core.grammars import Grammars
from coreserve.engine_core.hybrid_memory import hybrid_memory
from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.kv_event_log import KVEventLog
from coreserve.engine_core.kv_event_publisher import KVEventPublisher
from coreserve.engine_core.lora_table import LoraTable
from coreserve.engine_core.request import Request, RequestStatus
from coreserve.engine_core.rl_control import CoreControl, pinned_error
from coreserve.engine_core.scheduler import Scheduler
from coreserve.protocol import PROTOCOL_VERSION
from coreserve.protocol.config import EngineConfig
from coreserve.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    HandshakeReply,
)
from coreserve.protocol.model_facts import eos_token_ids, tokenizer_fingerprint
from coreserve.protocol.request_rules import RequestLimits, RequestRuleError, check_request
from coreserve.worker.executor import Executor, RunnerSpec, make_executor

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, on_progress: Callable[[], None] | None = None,
                 owns_process: bool = False) -> None:
        """`on_progress`: called as the model moves within a step (each layer, each window step);
        `owns_process`: the core runs in its own process (python -m coreserve.engine_core), so it may set the
        process's torch threads; in a user's process it leaves every global setting as it found it."""
        self.config = config
        self.executor: Executor = make_executor(runner_spec(config, owns_process), on_progress)
        try:
            self._start(config)
        except BaseException:
            self.executor.close()
            raise

    def _start(self, config: EngineConfig) -> None:
        args = self.executor.model_args
        self.vocab_size = args.vocab_size
        self.num_moe_layers = len(args.moe_layers)
        self.num_hidden_layers, self.hidden_size = args.num_layers, args.hidden_size
        self.max_model_len = min(
            config.max_model_len or args.max_position_embeddings, args.max_position_embeddings
        )
        # runner="pooling": prompts only, each whole in one step (a budget of max_model_len at least, as vLLM
        # gives a pooling model without chunked prefill), no KV kept after it (no prefix cache)
        self.pooling = self.executor.pooling
        self.prefix_caching = config.enable_prefix_caching and self.pooling is None
        budget = config.max_num_batched_tokens
        self.max_num_batched_tokens = budget if self.pooling is None else max(budget, self.max_model_len)
        if self.max_num_batched_tokens != budget:
            logger.info("runner='pooling': max_num_batched_tokens %d raised to max_model_len %d (a prompt a step)",
                        budget, self.max_model_len)
        self.hybrid = hybrid_memory(config, args.state_bytes_per_seq, self.executor.bytes_per_block())
        self.num_kv_blocks = self._backed_num_blocks(config.num_kv_blocks or self._default_num_blocks())
        self.executor.allocate_kv_cache(self.num_kv_blocks, self.hybrid.num_state_slots,
                                        self.hybrid.num_snapshot_slots(self.num_kv_blocks))
        events = config.kv_events_config
        is_publishing = events is not None and events.is_publishing and self.prefix_caching
        if events is not None and events.is_publishing and not is_publishing:
            logger.warning("kv_events_config: prefix caching is off, so no KV-cache events are sent")
        if is_publishing and args.is_hybrid:  # a block is a hit only at a snapshot: announced blocks would lie
            logger.warning("kv_events_config: a hybrid model's KV-cache events are not built, so none are sent")
            is_publishing = False
        self.kv_events = KVEventLog(config.block_size) if is_publishing else None
        self.kv_cache = self._kv_pool()
        self.loras = LoraTable(self.executor, config.enable_lora, config.max_loras, config.max_cpu_loras,
                               config.lora_allowed_roots)
        self.loras.on_drop = lambda slot: self.kv_cache.forget_lora_load(slot)  # the pool of the moment
        self.eos_token_ids = eos_token_ids(config.model)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=self.hybrid.num_state_slots or config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_scheduler_steps=config.num_scheduler_steps,
            grammars=Grammars(config.model, self.vocab_size, self.eos_token_ids),
            speculative=config.speculative_config,
            long_rope_switch=args.long_rope_switch,
            loras=self.loras,
        )
        self.tokenizer_fingerprint = tokenizer_fingerprint(config.model)
        self.limits = RequestLimits.of(self.facts())
        self.control = CoreControl(self.scheduler, self.executor, self._reset_kv_pool)
        self.control.loras = self.loras
        self.kv_publisher = KVEventPublisher(events) if self.kv_events is not None else None  # last: it binds

    def _reset_kv_pool(self) -> None:
        """A fresh block pool (after sleep freed the KV cache): every block free, nothing indexed."""
        assert not self.scheduler.running
        previous = self.kv_cache.index
        self.kv_cache = self._kv_pool(previous.next_content_id if previous is not None else 1)
        self.scheduler.kv_cache = self.kv_cache
        if self.kv_events is not None:
            self.kv_events.cleared()

    def _kv_pool(self, first_content_id: int = 1) -> KVCacheManager:
        """Every block free, nothing indexed (content ids go on from `first_content_id`)."""
        config = self.config
        return KVCacheManager(self.num_kv_blocks, config.block_size, self.prefix_caching, self.kv_events,
                              first_content_id, self.hybrid.snapshots(self.num_kv_blocks, config.block_size))

    def _backed_num_blocks(self, num_blocks: int) -> int:
        """The KV cache's pages are committed as blocks are first written, so a cache the host cannot
        back would start and then fail under load. Where it lives in host memory it must fit in what
        the host has available now (0.9 of MemAvailable or of a cgroup's room, the weights loaded): a
        given num_kv_blocks that does not is refused, naming the flag; the default is cut to fit (at
        least one full-length sequence)."""
        need, available = self.executor.host_kv_bytes(num_blocks), host_memory_available()
        need += self.hybrid.state_bytes if need else 0  # a hybrid's state slots, where the KV cache is on the host
        if available is not None:
            available = int(available * KV_MEMORY_SHARE)
        if not need or available is None or need <= available:
            return num_blocks
        gib = f"{need / 2**30:.2f} GiB for {num_blocks} blocks, but this host has {available / 2**30:.2f} GiB available"
        if self.config.num_kv_blocks:
            raise ValueError(f"the KV cache needs {gib}: lower num_kv_blocks (--num-kv-blocks)")
        fit = num_blocks * available // need
        if fit < -(-self.max_model_len // self.config.block_size):
            raise ValueError(f"the KV cache needs {gib}, and less would not hold one sequence of max_model_len="
                             f"{self.max_model_len} tokens: lower max_model_len (--max-model-len) or free memory")
        logger.warning("the KV cache takes %d blocks, not %d: %s", fit, num_blocks, gib)
        return fit

    def _default_num_blocks(self) -> int:
        per_seq = -(-self.max_model_len // self.config.block_size)
        budget = int((self.config.kv_cache_gib * 2**30 - self.hybrid.state_bytes) // self.executor.bytes_per_block())
        max_num_seqs = self.hybrid.num_state_slots or self.config.max_num_seqs  # a hybrid runs no more
        return max(1, min(max_num_seqs * per_seq, budget))

    def stats(self, nonce: int = 0) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            nonce=nonce,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_kv_blocks=self.kv_cache.num_free_blocks,
            num_kv_blocks=self.num_kv_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_cached_blocks=self.kv_cache.num_cached_blocks,
            prefix_cache_queries=self.kv_cache.num_queried_tokens,
            prefix_cache_hits=self.kv_cache.num_hit_tokens,
            num_prefill_tokens=scheduler.num_prefill_tokens,
            num_state_slots=self.hybrid.num_state_slots,
            state_bytes_per_seq=self.hybrid.state_bytes_per_seq,
            num_state_snapshots=self.kv_cache.snapshots.num_snapshots if self.kv_cache.snapshots is not None else 0,
            running_lora_adapters=_adapter_names(scheduler.running),
            waiting_lora_adapters=_adapter_names(r for r in scheduler.requests.values() if r.status == RequestStatus.WAITING),
            **_speculative_stats(scheduler),
        )

    def facts(self) -> HandshakeReply:
        return HandshakeReply(
            protocol_version=PROTOCOL_VERSION,
            error=None,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_logprobs=self.config.max_logprobs,
            eos_token_ids=self.eos_token_ids,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            has_rl_control=True,
            num_moe_layers=self.num_moe_layers,
            num_hidden_layers=self.num_hidden_layers,
            **_hidden_states_facts(self.config, self.hidden_size),
            runner="generate" if self.pooling is None else "pooling",
            pooling=self.pooling,
        )

    def add_request(self, client_id: bytes, request: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queues the request; returns an error output instead when the core must refuse it."""
        error = self._check(client_id, request)
        if error is not None:
            logger.warning("refused request %s: %s", request.req_id, error)
            return EngineCoreOutput(request.req_id, [], finish_reason=FinishReason.ERROR, error=error)
        req = Request(
            req_id=core_req_id(client_id, request.req_id),
            client_id=client_id,
            client_req_id=request.req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=request.sampling_params,
            arrival_time=request.arrival_time,
            eos_token_ids=self.eos_token_ids,
            logprobs_mode=self.config.logprobs_mode,
        )
        self.scheduler.add_request(req)
        return None

    def _check(self, client_id: bytes, request: EngineCoreRequest) -> str | None:
        """The frontend checks the same rules first; this keeps a bad request from any client off the model."""
        try:
            check_request(request.prompt_token_ids, request.sampling_params, self.limits)
        except RequestRuleError as exc:
            return str(exc)
        if core_req_id(client_id, request.req_id) in self.scheduler.requests:
            return f"request id {request.req_id!r} is already in flight"
        pinned = request.sampling_params.weight_version
        if pinned is not None and pinned != self.control.weight_version:
            return pinned_error(pinned, self.control.weight_version)
        if request.sampling_params.lora is not None:  # read before a step once it can run (lora_table.py)
            try:
                self.loras.check(request.sampling_params.lora)
            except ValueError as exc:
                return str(exc)
        return None

    def abort_requests(self, client_id: bytes, req_ids: list[str]) -> None:
        self.scheduler.abort_requests([core_req_id(client_id, r) for r in req_ids])

    def abort_client(self, client_id: bytes) -> list[str]:
        """Aborts everything a client has in flight; returns the client's ids of those requests."""
        reqs = [r for r in self.scheduler.requests.values() if r.client_id == client_id]
        self.scheduler.abort_requests([r.req_id for r in reqs])
        return [r.client_req_id for r in reqs]

    def has_unfinished_requests(self) -> bool:
        """Whether a step would do anything: requests held by a pause or a sleep wait without steps."""
        return self.scheduler.has_schedulable_requests()

    def step(self) -> dict[bytes, EngineCoreOutputs]:
        for int_id, error in self.loras.load_wanted():  # adapters read between steps, never in schedule()
            self.scheduler.fail_adapter_waiters(int_id, error)
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute(scheduler_output)
        outputs = self.control.stamp(self.scheduler.update_from_output(scheduler_output, runner_output))
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """The prefix cache's events since the last call, as one batch (with --kv-events-config): after
        each step, and after a command that cleared the cache between steps."""
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.kv_events.take())

    def close(self) -> None:
        """Stops the tensor-parallel ranks, if any, the grammar thread and the KV event publisher; the core
        is not used after this."""
        self.scheduler.grammars.close()
        self.executor.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()


def _adapter_names(reqs) -> list[str]:
    return sorted({r.params.lora.name for r in reqs if r.params.lora is not None})


def _hidden_states_facts(config: EngineConfig, hidden_size: int) -> dict:
    """The handshake's word on return_hidden_states: the width, or why this core refuses them (tensor
    parallel ranks' outputs carry none: docs/logprobs.md, "Hidden states")."""
    if config.tensor_parallel_size > 1:
        return {"hidden_states_refusal": "not built under tensor parallelism (tensor_parallel_size > 1)"}
    return {"hidden_size": hidden_size}


def _speculative_stats(scheduler) -> dict:
    """The speculation counters since start (EngineStats' spec_* fields); none without speculation."""
    policy = scheduler.speculation
    if policy is None:
        return {}
    return dict(
        spec_num_drafts=policy.num_rounds,
        spec_num_draft_tokens=policy.num_draft_tokens,
        spec_num_accepted_tokens=policy.num_accepted_tokens,
        spec_accepted_per_position=list(policy.accepted_per_position),
    )


def runner_spec(config: EngineConfig, owns_process: bool = False) -> RunnerSpec:
    return RunnerSpec(
        owns_process=owns_process,
        model=config.model,
        dtype=config.dtype,
        device=config.device,
        block_size=config.block_size,
        seed=config.seed,
        can_use_cpu_kernels=config.can_use_cpu_kernels,
        kernel_variant=config.kernel_variant,
        batch_invariant=config.batch_invariant,
        quantized_activations=config.quantized_activations,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_lora=config.enable_lora,
        max_lora_rank=config.max_lora_rank,
        num_threads=config.num_threads,
        speculative=config.speculative_config,
        fill_empty_with_nan=config.fill_empty_with_nan,
        check_tensors=config.check_tensors,
        runner=config.runner,
    )


def core_req_id(client_id: bytes, req_id: str) -> str:
    """Request ids are per client; the core qualifies them so clients cannot collide."""
    return f"{client_id.hex()}/{req_id}"


KV_MEMORY_SHARE = 0.9  # of the memory available at start: the rest for the steps' scratch and the heap


def host_memory_available() -> int | None:
    """The bytes this process can still be given without swapping: /proc/meminfo's MemAvailable, less
    a cgroup's (a container's) limit where that is lower; None where unknown (not Linux)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available

