"""EngineConfig: built and validated once in the frontend (or the daemon's command line), then read-only."""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.sampling_params import LogprobsMode


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Engine arguments; names follow vLLM's engine args where vLLM has one."""

    model: str
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = (
        None  # None: enough for max_num_seqs full-length sequences, capped by kv_cache_gib
    )
    kv_cache_gib: float = 2.0
    seed: int = 0
    max_logprobs: int = 20  # -1: the whole vocabulary may be asked for
    logprobs_mode: LogprobsMode = "raw"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    num_scheduler_steps: int = 1
    num_threads: int | None = None  # torch intra-op threads in the core; None: torch's default
    # The C kernels (decode attention, logprob rows, fused layer steps) on the CPU in fp32, built with
    # the system cc; False: torch's ops only (the CUDA path), e.g. to rule the kernels out of a bug.
    can_use_cpu_kernels: bool = True

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or non-negative, got {self.max_logprobs}")
