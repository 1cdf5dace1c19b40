"""The fused decode forward: a decode-only step of few rows runs the whole model forward (embedding,
every decoder layer, the final norm) in one C call, `decode_forward.c`, the threads in one parallel
region, instead of ten calls a layer from Python (engine-core process).

It applies on the CPU with the C kernels when every token of the step is a decode row (one token
with context), there are at most `FUSED_MAX_ROWS` of them, and the layers are whole (no tensor
parallelism: the sums over ranks sit between a layer's halves). Elsewhere the op-by-op path runs;
both give the same numbers (Qwen3's per-head q/k norms: to float rounding, C's RMSNorm against
torch's). Token ids and positions are trusted as the scheduler bounds them (the C reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from worker.attention import AttentionMetadata
from worker.cpu.kernels import CpuKernels
from worker.cpu.linear import GEMV_MAX_ROWS

FUSED_MAX_ROWS = GEMV_MAX_ROWS  # the few-row products' range: past it prefill-sized products win


@dataclass
class FusedStep:
    """This step's rows as decode_forward.c reads them."""

    params: np.ndarray  # [11] int64: decode_forward.c's S_* entries
    keep_alive: tuple  # the tensors and arrays whose addresses `params` holds
    address: int = field(init=False)  # params' own (numpy's .ctypes.data costs ~2 us: once a step)

    def __post_init__(self) -> None:
        self.address = self.params.ctypes.data


@dataclass
class FusedModel:
    """The model as decode_forward.c reads it, built once per set of KV caches."""

    params: np.ndarray  # [7] int64: decode_forward.c's M_* entries
    layers: list[np.ndarray]  # per layer [20] int64: its L_* entries
    layer_addresses: np.ndarray  # [num_layers] int64: each layer's array
    caches: list[torch.Tensor]  # the KV caches the layers address, one a layer
    weights: list[torch.Tensor]  # tensors whose addresses it holds, checked each step (a sample: ~1 us each)
    address: int = field(init=False)
    weight_addresses: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.address = self.params.ctypes.data
        self.weight_addresses = [w.data_ptr() for w in self.weights]

    def is_for(self, caches: list[torch.Tensor]) -> bool:
        """Whether it still addresses these caches, and the weights where they are: they are placed
        once at load (huge pages) and never move after; the first and last layer stand for all."""
        return (
            len(caches) == len(self.caches)
            and all(a is b for a, b in zip(caches, self.caches))
            and all(w.data_ptr() == a for w, a in zip(self.weights, self.weight_addresses))
        )


def fused_step(
    kernels: CpuKernels | None, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor
) -> FusedStep | None:
    """The step's inputs for decode_forward.c, or None where the op-by-op path must run."""
    decode, num_tokens = meta.decode, input_ids.shape[0]
    if kernels is None or decode is None or meta.seqs or decode.gather is not None:
        return None
    if num_tokens > FUSED_MAX_ROWS or len(decode.rows) != num_tokens:
        return None
    # a multi-step window feeds back its sampled tokens, which may be a column of the top-k ids
    input_ids, positions, slots = (
        t if t.is_contiguous() else t.contiguous() for t in (input_ids, positions, meta.slot_mapping)
    )
    assert input_ids.dtype == positions.dtype == slots.dtype == torch.int64
    rows_ptr, tables_ptr, lens_ptr = decode.pointers
    params = np.array(
        [
            input_ids.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            rows_ptr,
            tables_ptr,
            decode.block_tables.shape[1],
            lens_ptr,
            num_tokens,
            decode.block_size,
            int(kernels.has_bf16_dot),
            torch.get_num_threads(),
        ],
        dtype=np.int64,
    )
    return FusedStep(params, (input_ids, positions, slots, decode))


def fused_model(model: nn.Module, caches: list[torch.Tensor]) -> FusedModel:
    """`model` (a LlamaModel on the CPU kernels) over its `caches`."""
    assert len(caches) == len(model.layers) > 0
    layers = [layer_params(layer, cache) for layer, cache in zip(model.layers, caches)]
    assert len({tuple(p[12:17]) + (p[18],) for p in layers}) == 1, (
        "decode_forward.c reads one shape for all layers"
    )
    addresses = np.array([layer.ctypes.data for layer in layers], dtype=np.int64)
    embed = model.embed_tokens.weight
    assert embed.dtype in (torch.float32, torch.bfloat16) and embed.is_contiguous()
    params = np.array(
        [
            embed.data_ptr(),
            int(embed.dtype == torch.bfloat16),
            _address(model.norm.weight),
            _address(model.rotary.cos),
            _address(model.rotary.signed_sin),
            len(layers),
            addresses.ctypes.data,
        ],
        dtype=np.int64,
    )
    first, last = model.layers[0], model.layers[-1]
    weights = [embed, model.norm.weight, model.rotary.cos, first.qkv_proj.weight, last.down_proj.weight]
    return FusedModel(params, layers, addresses, list(caches), weights)


def layer_params(layer: nn.Module, cache: torch.Tensor) -> np.ndarray:
    """[20] int64: decode_forward.c's L_* entries for `layer` (a DecoderLayer) over `cache`."""
    a = layer.args
    weights = [layer.qkv_proj.weight, layer.o_proj.weight, layer.gate_up_proj.weight, layer.down_proj.weight]
    assert all(w.dtype == weights[0].dtype and w.is_contiguous() for w in weights)
    assert cache.is_contiguous() and cache.dtype == torch.float32
    qk_norms = (layer.q_norm.weight, layer.k_norm.weight) if a.has_qk_norm else (None, None)
    key_cache = cache.data_ptr()
    return np.array(
        [
            _address(layer.input_layernorm.weight),
            weights[0].data_ptr(),
            _address(layer.qkv_proj.bias),
            _address(qk_norms[0]),
            _address(qk_norms[1]),
            weights[1].data_ptr(),
            _address(layer.o_proj.bias),
            _address(layer.post_attention_layernorm.weight),
            weights[2].data_ptr(),
            weights[3].data_ptr(),
            key_cache,
            key_cache + cache.stride(0) * cache.element_size(),
            a.hidden_size,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.intermediate_size,
            cache.shape[2],
            int(weights[0].dtype == torch.bfloat16),
            a.sliding_window or 0,
        ],
        dtype=np.int64,
    )


def decode_forward(
    kernels: CpuKernels, model: FusedModel, step: FusedStep, hidden_size: int, eps: float, scale: float
) -> torch.Tensor:
    """The final-normed hidden states [T, hidden] float32 of the step's tokens."""
    out = torch.empty(int(step.params[7]), hidden_size)
    if kernels.decode_forward(model.address, step.address, out.data_ptr(), eps, scale) != 0:
        raise MemoryError("the fused decode forward could not allocate its scratch memory")
    return out


def _address(tensor: torch.Tensor | None) -> int:
    """A float32 parameter's address; 0 for none."""
    if tensor is None:
        return 0
    assert tensor.dtype == torch.float32 and tensor.is_contiguous()
    return tensor.data_ptr()
