"""EngineCore: the model runner and the scheduler, driven one step at a time (engine-core process).

It knows nothing of sockets; the server (or the in-process client) feeds it requests and takes outputs.
"""

from __future__ import annotations

import logging

import torch

from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from protocol import PROTOCOL_VERSION
from protocol.config import EngineConfig
from protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    HandshakeReply,
)
from protocol.model_facts import eos_token_ids, tokenizer_fingerprint
from worker.model_runner import ModelRunner
from worker.parallel.executor import TensorParallelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = make_runner(config)
        try:
            self._start(config)
        except BaseException:
            self.runner.close()
            raise

    def _start(self, config: EngineConfig) -> None:
        args = self.runner.model_args
        self.vocab_size = args.vocab_size
        self.max_model_len = min(
            config.max_model_len or args.max_position_embeddings, args.max_position_embeddings
        )
        self.num_kv_blocks = config.num_kv_blocks or self._default_num_blocks()
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        self.kv_cache = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.num_scheduler_steps,
        )
        self.eos_token_ids = eos_token_ids(config.model)
        self.tokenizer_fingerprint = tokenizer_fingerprint(config.model)

    def _default_num_blocks(self) -> int:
        per_seq = -(-self.max_model_len // self.config.block_size)
        budget = int(self.config.kv_cache_gib * 2**30 // self.runner.bytes_per_block())
        return max(1, min(self.config.max_num_seqs * per_seq, budget))

    def stats(self, nonce: int = 0) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            nonce,
            len(scheduler.running),
            len(scheduler.waiting),
            self.kv_cache.num_free_blocks,
            self.num_kv_blocks,
            scheduler.num_preemptions,
            self.kv_cache.num_cached_blocks,
            self.kv_cache.num_queried_tokens,
            self.kv_cache.num_hit_tokens,
            scheduler.num_prefill_tokens,
        )

    def facts(self) -> HandshakeReply:
        return HandshakeReply(
            PROTOCOL_VERSION,
            None,
            self.vocab_size,
            self.max_model_len,
            self.config.max_logprobs,
            self.eos_token_ids,
            self.num_kv_blocks,
            self.config.block_size,
        )

    def add_request(self, client_id: bytes, request: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queues the request; returns an error output instead when the core must refuse it."""
        error = self._check(client_id, request)
        if error is not None:
            logger.warning("refused request %s: %s", request.req_id, error)
            return EngineCoreOutput(request.req_id, [], finish_reason=FinishReason.ERROR, error=error)
        req = Request(
            core_req_id(client_id, request.req_id),
            client_id,
            request.req_id,
            list(request.prompt_token_ids),
            request.sampling_params,
            request.arrival_time,
            self.eos_token_ids,
            self.config.logprobs_mode,
        )
        self.scheduler.add_request(req)
        return None

    def _check(self, client_id: bytes, request: EngineCoreRequest) -> str | None:
        """The frontend validates first; this keeps a bad request from any client off the model."""
        prompt, params = request.prompt_token_ids, request.sampling_params
        if not prompt:
            return "the prompt is empty"
        if len(prompt) >= self.max_model_len:
            return f"the prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return f"prompt token ids must be in [0, {self.vocab_size})"
        limit = self.config.max_logprobs
        for name, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if k is not None and limit != -1 and (k == -1 or k > limit):
                return f"{name}={k} is more than max_logprobs={limit}"
            if k is not None and k > self.vocab_size:
                return f"{name}={k} is more than the vocabulary ({self.vocab_size} tokens)"
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            if any(not 0 <= t < self.vocab_size for t in getattr(params, name) or ()):
                return f"{name} must be token ids in [0, {self.vocab_size}) (the vocabulary size)"
        if core_req_id(client_id, request.req_id) in self.scheduler.requests:
            return f"request id {request.req_id!r} is already in flight"
        max_len = min(len(prompt) + (params.max_tokens or self.max_model_len), self.max_model_len)
        needed = self.kv_cache.num_blocks_needed(max_len)
        if needed > self.num_kv_blocks:  # it could never finish, even alone
            return f"the request needs up to {needed} KV blocks; the cache has {self.num_kv_blocks}"
        return None

    def abort_requests(self, client_id: bytes, req_ids: list[str]) -> None:
        self.scheduler.abort_requests([core_req_id(client_id, r) for r in req_ids])

    def abort_client(self, client_id: bytes) -> list[str]:
        """Aborts everything a client has in flight; returns the client's ids of those requests."""
        reqs = [r for r in self.scheduler.requests.values() if r.client_id == client_id]
        self.scheduler.abort_requests([r.req_id for r in reqs])
        return [r.client_req_id for r in reqs]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> dict[bytes, EngineCoreOutputs]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any; the core is not used after this."""
        self.runner.close()


def make_runner(config: EngineConfig) -> ModelRunner | TensorParallelRunner:
    """The model in this process, or split over `tensor_parallel_size` worker processes."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(
            config.model,
            config.dtype,
            config.device,
            config.block_size,
            config.seed,
            config.can_use_cpu_kernels,
        )
    return TensorParallelRunner(
        config.model,
        config.dtype,
        config.device,
        config.block_size,
        config.seed,
        config.can_use_cpu_kernels,
        config.tensor_parallel_size,
        config.num_threads or max(1, torch.get_num_threads() // config.tensor_parallel_size),
    )


def core_req_id(client_id: bytes, req_id: str) -> str:
    """Request ids are per client; the core qualifies them so clients cannot collide."""
    return f"{client_id.hex()}/{req_id}"
