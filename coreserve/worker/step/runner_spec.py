"""`RunnerSpec`: the frozen spec an executor, and each tensor-parallel rank's runner, is built from,
taken from EngineConfig (engine-core process; it travels to rank processes as JSON)."""

from __future__ import annotations

import msgspec

from coreserve.protocol.config import SpeculativeConfig


class RunnerSpec(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    dtype: str
    device: str
    block_size: int
    seed: int
    can_use_cpu_kernels: bool = True
    kernel_variant: str = "auto"  # EngineConfig's: which build of the C kernels (kernel_variants.py)
    batch_invariant: bool = True  # EngineConfig's: one order of summation per row, whatever the batch
    quantized_activations: str = "float32"  # EngineConfig's: "int8" takes the integer-mode products
    tensor_parallel_size: int = 1
    enable_lora: bool = False  # EngineConfig's: LoRA deltas in the products (coreserve/worker/lora/), no fused step
    max_lora_rank: int = 16
    num_threads: int | None = None  # torch threads in each rank process; None: shared out among them
    speculative: SpeculativeConfig | None = None  # the proposer the runner builds; None: no speculation
    # The runner has its process to itself (a spawned core, a daemon, a rank): the thread governor may set
    # the process's torch threads. False in a user's process (LLM(multiprocess=False)): never touched.
    owns_process: bool = False
    fill_empty_with_nan: bool = False  # EngineConfig's debug switch (coreserve/worker/nan_empties.py)
    check_tensors: bool = True  # EngineConfig's: weights holding NaN or infinities refused where they enter
    runner: str = "auto"  # EngineConfig's: "generate", "pooling" or "auto" (resolved by the model at load)
