"""The fused decode forward: a decode-only step of few rows runs the whole model forward (embedding,
every decoder layer, the final norm) in one C call, csrc/decode_forward.c, the threads in one
parallel region, instead of ten calls a layer from Python (engine-core process).

`CpuBackend` (backend.py) builds a `FusedForward` for its model and KV caches, and asks it for
each step: it applies when every token of the step is a decode row (one token with context)
and there are at most `FUSED_MAX_ROWS` of them; elsewhere the model runs op by op. The model is
read through `DecoderModel.weights()`, its one description of its tensors; the C reads it as
`struct model_desc` (bindings.py). Weights kept in GGUF blocks take the quantized products
(csrc/gemv_quant.c), the embedding rows dequantized in C: the numbers of the op-by-op path still.
Both paths give the same numbers, bit for bit (Qwen3's per-head q/k norms too: the same C norm each
head). Token ids and positions are trusted as the scheduler bounds them (the C reads them). Layers
split over ranks (tensor parallelism) never come here: the sums over ranks sit between a layer's halves.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from coreserve.worker.cpu.attention_plan import CpuAttentionPlan
from coreserve.worker.cpu.bindings import CpuKernels, LayerDesc, ModelDesc, StepDesc
from coreserve.worker.cpu.linear import GEMV_MAX_ROWS
from coreserve.worker.cpu.quant_linear import part_array_address
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.decoder import LayerWeights, ModelWeights
from coreserve.worker.models.quantized import QUANT_PARTS, ggml_type_of
from coreserve.worker.models.rope import NO_ROPE
from coreserve.worker.step.input_batch import StepInputs

FUSED_MAX_ROWS = GEMV_MAX_ROWS  # the few-row products' range: past it prefill-sized products win


class FusedStep:
    """This step's rows as decode_forward.c reads them, and the tensors whose addresses it holds."""

    def __init__(self, desc: StepDesc, keep_alive: tuple, logits: torch.Tensor | None = None) -> None:
        self.desc = desc
        self.keep_alive = keep_alive
        self.logits = logits  # [T, vocab] float32, written by the run where asked; None: not asked
        self.pointer = ctypes.byref(desc)


LORA_SHARE_ROWS = 64  # csrc/lora_rows.h: the rows lora_rows_share takes (a fused step has at most FUSED_MAX_ROWS)


@dataclass
class FusedLora:
    """A step's LoRA for decode_forward.c: each row's group [T] int32 (-1: none), the groups' parts of each
    product (4 a layer: qkv, o, gate_up, down; then lm_head) as addresses of LoraGroup arrays (0: none)."""

    groups: torch.Tensor
    products: ctypes.Array
    num_groups: int
    keep_alive: object = None


class FusedForward:
    """The model as decode_forward.c reads it, over one set of KV caches (one a layer). The weights
    are placed once at load (huge pages) and never move after; the caches are those given."""

    def __init__(
        self, kernels: CpuKernels, weights: ModelWeights, caches: list[torch.Tensor], args: DecoderArgs,
        is_int8: bool = False,
    ) -> None:
        assert len(caches) == len(weights.layers) > 0
        self.kernels, self.args, self.caches = kernels, args, list(caches)
        # else every step runs op by op (and always where a layer spec is not llama-shaped: experts, GeGLU, ...)
        self.applies = _can_read(weights.layers) and args.is_llama_shaped
        if not self.applies:
            return
        is_bf16 = _is_bf16(weights.layers)
        self.layers = (LayerDesc * len(caches))(
            *(layer_desc(w, cache, args, i, is_bf16) for i, (w, cache) in enumerate(zip(weights.layers, caches)))
        )
        shapes = {tuple(getattr(d, f) for f in _SHAPE_FIELDS) for d in self.layers}
        assert len(shapes) == 1, "decode_forward.c reads one shape for all layers"
        embed = weights.embed
        assert embed.dtype in (torch.float32, torch.bfloat16, torch.uint8) and embed.is_contiguous()
        self.desc = ModelDesc(
            embed=embed.data_ptr(),
            embed_is_bf16=int(embed.dtype == torch.bfloat16),
            final_norm=_address(weights.final_norm),
            cos=_address(weights.cos),
            sin=_address(weights.sin),
            num_layers=len(caches),
            layers=self.layers,
            embed_quant_type=ggml_type_of(embed),
            **_lm_head_fields(weights),
            int8_activations=int(is_int8),
        )
        self.vocab = self.desc.vocab  # 0: lm_head stays with the op-by-op product
        scales = {spec.attention.scale for spec in args.layers}
        assert len(scales) == 1, "decode_forward.c reads one attention scale for all layers"
        scale = scales.pop()
        self.scale = args.head_dim**-0.5 if scale is None else scale  # the kernels' reading of AttentionSpec
        self.keep_alive = weights  # the tensors whose addresses the descriptors hold
        self.pointer = ctypes.byref(self.desc)

    def step(self, inputs: StepInputs, with_logits: bool = False, lora: FusedLora | None = None) -> FusedStep | None:
        """The step's rows for decode_forward.c, or None where the op-by-op path must run; with_logits:
        lm_head's products of every row too, in the same region (where the model's lm_head has them);
        `lora`: the adapters' deltas of the step's rows (coreserve/worker/cpu/grouped_lora.py's fused)."""
        meta, num_tokens = inputs.attn, inputs.input_ids.shape[0]
        decode = meta.decode
        if not self.applies or decode is None or meta.seqs or num_tokens > FUSED_MAX_ROWS:
            return None
        if len(decode.rows) != num_tokens:
            return None
        assert isinstance(meta.plan, CpuAttentionPlan) and meta.plan.decode is not None  # CpuBackend.prepare
        # a multi-step window feeds back its sampled tokens, which may be a column of the top-k ids
        input_ids, rope_rows, slots = (
            t if t.is_contiguous() else t.contiguous()
            for t in (inputs.input_ids, inputs.rope_rows, meta.slot_mapping)
        )
        assert input_ids.dtype == rope_rows.dtype == slots.dtype == torch.int64
        rows_ptr, tables_ptr, lens_ptr = meta.plan.decode.pointers
        desc = StepDesc(
            input_ids=input_ids.data_ptr(),
            positions=rope_rows.data_ptr(),  # read only as rows of the RoPE tables
            slots=slots.data_ptr(),
            rows=rows_ptr,
            block_tables=tables_ptr,
            max_blocks=decode.block_tables.shape[1],
            context_lens=lens_ptr,
            num_tokens=num_tokens,
            block_size=decode.block_size,
            use_dot=int(self.kernels.has_bf16_dot),
            num_threads=torch.get_num_threads(),
        )
        logits = torch.empty(num_tokens, self.vocab) if with_logits and self.vocab else None
        if logits is not None:
            desc.logits = logits.data_ptr()
        if lora is not None:
            assert lora.groups.shape[0] == num_tokens <= LORA_SHARE_ROWS
            assert len(lora.products) == 4 * len(self.caches) + 1
            desc.lora_groups, desc.num_lora_groups = lora.groups.data_ptr(), lora.num_groups
            desc.lora_products = ctypes.addressof(lora.products)
        return FusedStep(desc, (input_ids, rope_rows, slots, meta.plan, lora), logits)

    def run(self, step: FusedStep) -> torch.Tensor:
        """The final-normed hidden states [T, hidden] float32 of the step's tokens (and step.logits
        filled where the step asked for them)."""
        a = self.args
        out = torch.empty(step.desc.num_tokens, a.hidden_size)
        status = self.kernels.decode_forward(self.pointer, step.pointer, out.data_ptr(), a.rms_norm_eps, self.scale)
        if status != 0:
            raise MemoryError("the fused decode forward could not allocate its scratch memory")
        return out


def _lm_head_fields(weights: ModelWeights) -> dict:
    """ModelDesc's lm_head fields: its weight where decode_forward.c's products take it as the op-by-op
    path's few-row product does (gemv.c's fp32 or bf16, gemv_quant.c's blocks), else vocab 0."""
    weight, bias = weights.lm_head, weights.lm_head_bias
    quant_type = 0 if weight is None else ggml_type_of(weight)
    kinds = (torch.float32, torch.bfloat16) if not quant_type else (torch.uint8,)
    if weight is None or weight.dtype not in kinds or not weight.is_contiguous():
        return {"vocab": 0}
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return {"vocab": 0}
    return {"lm_head": weight.data_ptr(), "lm_head_bias": _address(bias),
            "lm_head_is_bf16": int(weight.dtype == torch.bfloat16), "lm_head_quant_type": quant_type,
            "vocab": weight.shape[0]}


_SHAPE_FIELDS = ("hidden", "num_q_heads", "num_kv_heads", "head_dim", "intermediate", "is_bf16")


def _can_read(layers: list[LayerWeights]) -> bool:
    """Whether decode_forward.c can read every layer's products: each product is GGUF blocks of its own
    ggml type (any kept type, or runs of several: a Q4_K_M file mixes Q4_K and Q6_K within and across
    layers), or floats,
    all of one dtype (fp32 or bf16: the layers share is_bf16). Models of fp32 and bf16 products both
    run op by op."""
    products = [p for w in layers for p in (w.qkv, w.o, w.gate_up, w.down)]
    if any(p is None for p in products):  # a mixture of experts' layer
        return False
    float_dtypes = {p.dtype for p in products if not ggml_type_of(p)}
    return len(float_dtypes) <= 1 and float_dtypes <= {torch.float32, torch.bfloat16}


def _is_bf16(layers: list[LayerWeights]) -> int:
    """The model's float products are bf16 (decode_forward.c reads one flag for every layer)."""
    return int(any(p.dtype == torch.bfloat16 for w in layers for p in (w.qkv, w.o, w.gate_up, w.down)))


def layer_desc(w: LayerWeights, cache: torch.Tensor, a: DecoderArgs, index: int, is_bf16: int) -> LayerDesc:
    """Layer `index`'s struct layer_desc over its `cache` [2, Hkv, slots, D] float32; its window is its
    spec's (AttentionSpec.window, 0: none), as the op-by-op attention reads it, and so is its NoPE."""
    products = (w.qkv, w.o, w.gate_up, w.down)
    assert _can_read([w]) and all(p.is_contiguous() for p in products)
    assert cache.is_contiguous() and cache.dtype == torch.float32
    key_cache = cache.data_ptr()
    return LayerDesc(
        input_norm=_address(w.input_norm), qkv=_product(w.qkv), qkv_bias=_address(w.qkv_bias),
        q_norm=_address(w.q_norm), k_norm=_address(w.k_norm), o=_product(w.o), o_bias=_address(w.o_bias),
        post_norm=_address(w.post_norm), gate_up=_product(w.gate_up), down=_product(w.down),
        key_cache=key_cache, value_cache=key_cache + cache.stride(0) * cache.element_size(),
        hidden=a.hidden_size, num_q_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
        intermediate=a.intermediate_size, num_slots=cache.shape[2],
        is_bf16=is_bf16, window=a.layers[index].attention.window or 0, qkv_type=ggml_type_of(w.qkv), o_type=ggml_type_of(w.o),
        gate_up_type=ggml_type_of(w.gate_up), down_type=ggml_type_of(w.down),
        is_nope=int(a.layers[index].rope.rope_type == NO_ROPE),
    )


def _product(weight: torch.Tensor) -> int:
    """What a product's pointer in struct layer_desc holds: the weight's address, or for runs of rows of
    several ggml types (QUANT_PARTS) their struct quant_part array's, kept on the weight."""
    return part_array_address(weight) if ggml_type_of(weight) == QUANT_PARTS else weight.data_ptr()


def _address(tensor: torch.Tensor | None) -> int | None:
    """A float32 parameter's address; None (NULL) for none."""
    if tensor is None:
        return None
    assert tensor.dtype == torch.float32 and tensor.is_contiguous()
    return tensor.data_ptr()
