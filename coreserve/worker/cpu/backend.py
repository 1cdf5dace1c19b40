"""The CPU backend: the model on the C kernels (engine-core process). fp32 activations and KV cache;
the linear weights in one mapping collapsed into huge pages once loaded (streamed once a step: fewer
TLB misses); each step's attention plan with its addresses (attention_plan.py); a decode-only step of
few rows as one C call (fused_decode.py); the sampling passes in C (sampling_ops.py); the LoRA adapters'
deltas one C call a product (grouped_lora.py), in the fused step too; the threads a step takes, fewer
while another busy process shares the cores (thread_governor.py).
The Backend protocol is coreserve/worker/backend.py's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from coreserve.worker.cpu.attention_plan import cpu_attention_plan
from coreserve.worker.cpu.bindings import CpuKernels
from coreserve.worker.cpu.fused_decode import FusedForward
from coreserve.worker.cpu.grouped_lora import CpuGroupedLora
from coreserve.worker.cpu.huge_pages import (
    COLLAPSE_DELAY_S,
    collapse_in_background,
    move_linear_weights_to_huge_pages,
    place_linear_weights,
    zeroed_kv_caches,
)
from coreserve.worker.cpu.ops import apply_cpu_backend
from coreserve.worker.cpu.sampling_ops import CpuSamplingOps
from coreserve.worker.cpu.thread_governor import ThreadGovernor
from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.quantized import QuantLinear
from coreserve.worker.step.attention import AttentionMetadata
from coreserve.worker.step.hidden_keep import HiddenKeep
from coreserve.worker.step.input_batch import StepInputs


class CpuBackend:
    """`can_fuse`: the fused decode forward may run (not under tensor parallelism); `governs_threads`: the
    process is the engine's own, whose torch threads follow the host (thread_governor.py); in a user's
    process a step takes at most the threads the user set, and the user's count is theirs between steps.
    `is_int8`: integer mode's products for the weights kept in GGUF blocks (quant_linear.py)."""

    name = "cpu"

    def __init__(self, kernels: CpuKernels, is_batch_invariant: bool, block_size: int, can_fuse: bool,
                 governs_threads: bool = False, is_int8: bool = False) -> None:
        self.kernels = kernels
        self.is_batch_invariant = is_batch_invariant
        self.is_int8 = is_int8
        self.block_size = block_size
        self.can_fuse = can_fuse
        self.sampling = CpuSamplingOps(kernels)
        self.fused: FusedForward | None = None  # over the KV caches bound last; None: none bound
        self.lora: CpuGroupedLora | None = None  # the LoRA products handed out (lora_products); None: LoRA off
        self.huge_page_memory: torch.Tensor | None = None  # the linear weights' mapping, until collapsed
        self.closed = threading.Event()  # the engine is done: the huge-page collapse stops
        self.collapse: threading.Thread | None = None
        self.threads = ThreadGovernor(torch.get_num_threads(), guest=not governs_threads)

    def place(self, model: DecoderModel) -> None:
        """The linear weights' place, before they are read, so that they are written once, there."""
        self.huge_page_memory = place_linear_weights(model, keep_values=False)

    def adopt(self, model: DecoderModel, is_busy: Callable[[], bool]) -> None:
        """Written: the mapping goes into huge pages in the background, off the first token's path
        (it waits while `is_busy`); the model runs on CpuOps."""
        if self.huge_page_memory is not None:
            self.collapse = collapse_in_background(self.huge_page_memory, busy=is_busy,
                                                   delay_s=COLLAPSE_DELAY_S, stop=self.closed)
            self.huge_page_memory = None
        if self.is_int8 and not any(isinstance(m, QuantLinear) for m in model.modules()):
            raise ValueError("quantized_activations='int8' applies to weights kept in GGUF blocks; this model "
                             "has none (a GGUF file of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K or MXFP4 tensors, or "
                             "gpt-oss's MXFP4 experts, dtype auto)")
        apply_cpu_backend(model, self.kernels, self.is_batch_invariant, self.is_int8)

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def allocate_kv_cache(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        return zeroed_kv_caches(num_layers, shape, dtype, torch.device("cpu"))

    def lora_products(self) -> CpuGroupedLora:
        """The adapters' deltas in C, for the model's LoRA ops; the fused forward reads the same."""
        self.lora = CpuGroupedLora(self.kernels)
        return self.lora

    def prepare(self, attn: AttentionMetadata) -> None:
        attn.plan = cpu_attention_plan(attn, self.is_batch_invariant, self.block_size)

    def bind(self, model: DecoderModel, caches: list[torch.Tensor]) -> None:
        """The fused forward's descriptors hold the weights' and caches' addresses: built over these."""
        if self.can_fuse and caches:
            self.fused = FusedForward(self.kernels, model.weights(), caches, model.args, self.is_int8)

    def step_threads(self) -> contextlib.AbstractContextManager:
        """The threads of the step run in this block: fewer while another busy process shares the cores."""
        return self.threads.step()

    def release(self) -> None:
        self.fused = None

    def close(self) -> None:
        """Stops the collapse and waits for it (at most one 2 MiB page's madvise): its thread holds the
        weights' mapping and the runner, which are freed once it is gone."""
        self.closed.set()
        if self.collapse is not None:
            self.collapse.join()

    def renew_weight_memory(self, model: DecoderModel) -> None:
        move_linear_weights_to_huge_pages(model)  # fresh memory: rewritten next

    def forward(
        self,
        model: DecoderModel,
        inputs: StepInputs,
        caches: list[torch.Tensor],
        on_progress: Callable[[], None] | None,
        keep: HiddenKeep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused decode forward where it applies (with lm_head's logits when every row samples, and
        the LoRA adapters' deltas of the step's rows where grouped_lora.py can give them), else
        the model op by op. The two paths give the same bits, so no row depends on which was taken.
        `keep` naming a layer below the final norm: op by op (the fused step keeps no layer's output)."""
        wants_logits = inputs.sample_rows is None  # every row samples (a decode-only step)
        lora = None
        if inputs.lora_rows is not None and self.fused is not None and self.lora is not None:
            lora = self.lora.fused(model)
        can_fuse = self.fused is not None and (inputs.lora_rows is None or lora is not None)
        can_fuse = can_fuse and (keep is None or not keep.layers)
        step = self.fused.step(inputs, wants_logits, lora) if can_fuse else None
        if step is None:
            return model(inputs.input_ids, inputs.rope_rows, caches, inputs.attn, on_progress, keep), None
        hidden = self.fused.run(step)
        if on_progress is not None:
            on_progress()
        return hidden, step.logits
