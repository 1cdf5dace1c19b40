"""The backend: the one object that knows how the model runs on this device (engine-core process, and
each tensor-parallel rank). The runner asks it, and nothing else decides it again:
- where the weights live (`place`, before they are read) and what the loaded model runs on (`adopt`:
  the ops object, huge pages collapsed off the first token's path);
- the activations' and KV cache's dtype, and the KV cache's memory;
- the attention plan of each step, made before the forward (`prepare`), never filled during it;
- the forward itself: a fast path where one applies (the CPU's fused decode step), else the model op
  by op (also where a request asks for a layer's hidden states, which only that path keeps); what must be rebuilt when the weights or the KV cache move (`bind`, `release`,
  `renew_weight_memory`);
- the sampling ops (top-k logprob rows, argmax) the sampler and prompt logprobs run on;
- the LoRA adapters' grouped products (`lora_products`: one call a product for every adapter of the
  step, which the model's LoRA ops are handed; None: torch's products an adapter at a time).

`TorchBackend` (torch's ops: CUDA, or the CPU without a compiler or with other dtypes) is here;
`CpuBackend` (the C kernels) in coreserve/worker/cpu/backend.py. A new device is a new Backend.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from coreserve.worker.cpu.backend import CpuBackend
from coreserve.worker.cpu.huge_pages import zeroed_kv_caches
from coreserve.worker.cpu.kernels import load_cpu_kernels
from coreserve.worker.lora.lora_ops import GroupedProducts
from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.loader import weights_dtype
from coreserve.worker.sampling.logprobs import SamplingOps, TorchSamplingOps
from coreserve.worker.step.attention import AttentionMetadata, decode_gather
from coreserve.worker.step.hidden_keep import HiddenKeep
from coreserve.worker.step.input_batch import StepInputs
from coreserve.worker.step.runner_spec import RunnerSpec

logger = logging.getLogger(__name__)

ProgressHook = Callable[[], None] | None  # after each layer / fused step: the core's liveness


class Backend(Protocol):
    name: str  # "torch" or "cpu"
    sampling: SamplingOps

    def place(self, model: DecoderModel) -> None: ...  # allocated, before the weights are read
    def adopt(self, model: DecoderModel, is_busy: Callable[[], bool]) -> None: ...  # loaded: ops set
    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype: ...  # activations and KV cache
    def allocate_kv_cache(
        self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> list[torch.Tensor]: ...  # one zeroed [2, Hkv, slots, D] cache a layer
    def prepare(self, attn: AttentionMetadata) -> None: ...  # sets attn.plan, before the forward
    def bind(self, model: DecoderModel, caches: list[torch.Tensor]) -> None: ...  # fast path over these
    def step_threads(self) -> contextlib.AbstractContextManager: ...  # the `with` block of one step
    def release(self) -> None: ...  # the KV cache is gone (sleep): drop what reads it
    def close(self) -> None: ...  # the engine is done: stop what runs beside its steps
    def renew_weight_memory(self, model: DecoderModel) -> None: ...  # the weights got fresh memory
    def lora_products(self) -> GroupedProducts | None: ...  # LoRA on: the adapters' deltas, None: torch's
    def forward(
        self, model: DecoderModel, inputs: StepInputs, caches: list[torch.Tensor], on_progress: ProgressHook,
        keep: HiddenKeep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # hidden [T, hidden], logits [T, vocab] or None


class TorchBackend:
    """torch's ops in the weights' dtype (fp32 for GGUF blocks), any device: the model's own TorchOps."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sampling: SamplingOps = TorchSamplingOps()

    def place(self, model: DecoderModel) -> None:
        """Where the loader allocated them."""

    def adopt(self, model: DecoderModel, is_busy: Callable[[], bool]) -> None:
        """The model's TorchOps, as built."""

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if weight_dtype == torch.uint8 else weight_dtype  # uint8: GGUF blocks

    def allocate_kv_cache(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        return zeroed_kv_caches(num_layers, shape, dtype, self.device)

    def prepare(self, attn: AttentionMetadata) -> None:
        if attn.decode is not None:
            attn.plan = decode_gather(attn.decode, self.device)

    def bind(self, model: DecoderModel, caches: list[torch.Tensor]) -> None:
        """No fast path: nothing reads the caches' addresses."""

    def step_threads(self) -> contextlib.AbstractContextManager:
        """torch's threads as they are."""
        return contextlib.nullcontext()

    def release(self) -> None:
        """Nothing holds the caches."""

    def close(self) -> None:
        """Nothing runs beside the steps."""

    def renew_weight_memory(self, model: DecoderModel) -> None:
        """Nothing holds the weights' addresses."""

    def lora_products(self) -> GroupedProducts | None:
        """None: torch's products, an adapter's rows at a time (coreserve/worker/lora/lora_ops.py)."""
        return None

    def forward(
        self, model: DecoderModel, inputs: StepInputs, caches: list[torch.Tensor], on_progress: ProgressHook,
        keep: HiddenKeep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return model(inputs.input_ids, inputs.rope_rows, caches, inputs.attn, on_progress, keep), None


def choose_backend(spec: RunnerSpec, device: torch.device, is_sharded: bool) -> Backend:
    """The C kernels on the CPU for fp32 and bf16 weights (and GGUF blocks), where a compiler builds
    them; torch's ops elsewhere. `is_sharded`: tensor parallelism, whose sums between a layer's halves
    keep the fused decode forward out."""
    kernel_dtypes = (torch.float32, torch.bfloat16)
    is_int8 = spec.quantized_activations == "int8"
    if is_int8 and (not spec.can_use_cpu_kernels or device.type != "cpu"):
        raise ValueError("quantized_activations='int8' runs on the CPU's C kernels only")
    if not spec.can_use_cpu_kernels or device.type != "cpu":
        return TorchBackend(device)
    if weights_dtype(spec.model, spec.dtype, device) not in kernel_dtypes:
        return TorchBackend(device)
    begun = time.perf_counter()
    kernels = load_cpu_kernels(setting=spec.kernel_variant)
    logger.info("startup: CPU kernels %.3f s", time.perf_counter() - begun)
    if kernels is None and is_int8:
        raise ValueError("quantized_activations='int8' needs the C kernels, which could not be built here")
    if kernels is None:
        return TorchBackend(device)
    return CpuBackend(kernels, spec.batch_invariant, spec.block_size, can_fuse=not is_sharded,
                      governs_threads=spec.owns_process, is_int8=is_int8)
