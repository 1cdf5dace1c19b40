"""Builds a model from a Hugging Face folder (config.json, then the safetensors weights) or a GGUF file
(coreserve/worker/models/gguf_*.py: the config from its metadata, its tensors dequantized or kept in their
blocks), one tensor at a time into the model's own parameters, in the target dtype on the target
device (engine-core process).

Loading holds the model once plus one checkpoint tensor (no fp32 copy of everything on the host). The
fused projections (q/k/v, gate/up) are filled row block by row block from their HF tensors.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from coreserve.protocol.gguf_header import is_gguf, read_gguf_header
from coreserve.worker.models import gguf_quantized, gguf_weights, safetensors_files
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.config_checks import check_layer_indices, check_model_fits_file
from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.family import family_of
from coreserve.worker.models.finite_weights import check_finite_model
from coreserve.worker.models.fused_experts import check_fused_part, fused_expert_part, split_fused_experts
from coreserve.worker.models.gguf_config import hf_config_from_gguf
from coreserve.worker.models.gguf_quantized import quantization_plan
from coreserve.worker.models.grouped_rows import grouped_rows
from coreserve.worker.models.mxfp4_experts import MXFP4_PARTS, checkpoint_values, load_mxfp4_part, mxfp4_plan
from coreserve.worker.models.quantized import block_rows, quantize_modules
from coreserve.worker.models.sharding import Shard, is_split, rank_part, shard_args
from coreserve.worker.models.weight_names import weight_destination

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed here


def read_config(model_dir: str) -> dict:
    """config.json, or what a GGUF file's metadata says in its keys."""
    if is_gguf(model_dir):
        return hf_config_from_gguf(read_gguf_header(model_dir))
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested past the parser
        raise ValueError(f"{path} is not a JSON file: {type(exc).__name__}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must be a JSON object, not {type(config).__name__}")
    return config


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype, as vLLM, except fp16 on the CPU, which runs in fp32 (a lossless
    widening: the CPU's fp16 matrix products are slow, and fp32 takes the C kernels)."""
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES.get(checkpoint_dtype, torch.float32)
    if dtype == torch.float16 and device.type == "cpu":
        logger.info("fp16 checkpoint on the CPU: running in float32 (dtype='auto')")
        return torch.float32
    return dtype


def weights_dtype(model_dir: str, dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype load_model gives the weights (those kept in GGUF blocks aside: uint8 blocks), known
    before anything is allocated: what a backend is chosen by."""
    return _weights_dtype(DecoderArgs.from_hf_config(read_config(model_dir)), model_dir, dtype, device)


def _weights_dtype(args: DecoderArgs, model_dir: str, dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and is_gguf(model_dir):
        return torch.float32  # what is not kept in blocks: its dequantized values, exactly
    return resolve_dtype(dtype, args.torch_dtype, device)


def load_model(
    model_dir: str,
    dtype: str | torch.dtype,
    device: torch.device,
    shard: Shard | None = None,
    place: Callable[[DecoderModel], None] | None = None,
    check_tensors: bool = True,
) -> DecoderModel:
    """`dtype`: a torch dtype, or a name ("auto", "float32", "bfloat16", "float16"); "auto" keeps a GGUF
    file's Q8_0/Q4_0/Q4_1/... weights in their blocks (gguf_quantized.py), the rest in fp32, and a gpt-oss
    folder's MXFP4 experts in theirs (mxfp4_experts.py), the rest in the folder's dtype. `shard`: this
    rank's part of a tensor-parallel model (its heads and MLP columns; coreserve/worker/models/sharding.py).
    `place`: called with the allocated model before its weights are read (where a backend wants its
    weights to live, so they are written once, there)."""
    config = read_config(model_dir)
    args = DecoderArgs.from_hf_config(config)
    file_shapes = _file_shapes(model_dir)
    check_layer_indices(args.num_layers, file_shapes, model_dir)
    if shard is not None and family_of(config).has_fused_checkpoint:
        raise ValueError(
            "tensor_parallel_size > 1 with a Phi-3 checkpoint (its fused qkv_proj and gate_up_proj split "
            "by q/k/v and gate/up parts) is not built"
        )
    if shard is not None and args.is_hybrid:
        raise ValueError("tensor_parallel_size > 1 with a hybrid model (recurrent layers, Qwen3.5) is not built")
    if shard is not None and any(spec.has_sinks for spec in args.layers):
        raise ValueError("tensor_parallel_size > 1 with gpt-oss (its attention sinks and experts' biases) is not "
                         "built")
    if shard is not None and any(spec.qk_norm == "whole" for spec in args.layers):
        raise ValueError(
            "tensor_parallel_size > 1 with OLMoE, OLMo 2 or OLMo 3 (their q/k norms span every head, across the "
            "ranks) is not built"
        )
    keeps_blocks = dtype == "auto" and is_gguf(model_dir)  # GGUF's default: its quantization kept
    keeps_mxfp4 = dtype == "auto" and args.moe is not None and args.moe.is_mxfp4  # so for MXFP4 experts
    dtype = _weights_dtype(args, model_dir, dtype, device)
    if shard is not None:
        args = shard_args(args, shard.size)
    with torch.device("meta"):
        model = DecoderModel(args)
    # float32 tables on the CPU, as HF computes them, kept out of the dtype cast (Gemma 3 has two)
    rotaries = {name: getattr(model, name) for name in ("rotary", "rotary_local") if getattr(model, name) is not None}
    for name in rotaries:
        delattr(model, name)
    if shard is None:  # a rank holds a part of each tensor
        file_values = sum(checkpoint_values(name, shape) for name, shape in file_shapes.items())
        check_model_fits_file(sum(p.numel() for p in model.parameters()), file_values, model_dir)
    _allocate(model, dtype, device)  # uninitialized: every byte is read below
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for name, rotary in rotaries.items():
        setattr(model, name, rotary.to(device))
    if keeps_blocks:
        quantize_modules(model, quantization_plan(model_dir, model, functools.partial(weight_destination, args)))
    if keeps_mxfp4:
        quantize_modules(model, mxfp4_plan(args))
    if place is not None:
        place(model)
    load_weights(model, model_dir, shard, check_tensors)
    return model.eval().requires_grad_(False)


def _file_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as the file's header states it (no tensor data read)."""
    if is_gguf(model_dir):
        return gguf_weights.file_shapes(model_dir)
    return {e.name: e.shape for e in safetensors_files.list_tensors(model_dir)}


def _allocate(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Gives every meta parameter and buffer uninitialized memory of `dtype` on `device` (floating ones;
    others keep theirs; a tensor shared by two modules stays shared). Not `to_empty`: its `empty_like`
    of meta tensors imports torch's symbolic shapes and sympy, 0.75 s of a start meant to take 4."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    kind = dtype if tensor.is_floating_point() else tensor.dtype
                    fresh = torch.empty(tensor.shape, dtype=kind, device=device)
                    is_param = isinstance(tensor, nn.Parameter)
                    made[id(tensor)] = nn.Parameter(fresh, tensor.requires_grad) if is_param else fresh
                table[name] = made[id(tensor)]


def load_weights(model: DecoderModel, model_dir: str, shard: Shard | None, check_tensors: bool = True) -> None:
    """Every tensor of the file into the model; `check_tensors`: none may hold a NaN or an infinity."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}  # parameter name -> elements written
    source = gguf_weights if is_gguf(model_dir) else safetensors_files
    entries = list(source.list_tensors(model_dir))
    by_name = {entry.name: entry for entry in entries}  # MXFP4's blocks find their scales here
    for entry in entries:
        if entry.name.endswith(_IGNORED_SUFFIXES) or entry.name.startswith(model.args.skipped_prefixes):
            continue
        fused = fused_expert_part(model.args, entry.name) if source is safetensors_files else None
        if fused is not None:  # gpt-oss: a layer's experts in one tensor (or MXFP4's two), split into each expert's
            for name, count in _fused_experts(params, model.args, fused, entry, by_name, model_dir).items():
                filled[name] = filled.get(name, 0) + count  # added: a tensor given twice fills twice over
            continue
        target = weight_destination(model.args, entry.name)
        if target is None:
            raise ValueError(f"{model_dir}: weight {entry.name} has no place in this model")
        name, rows = target
        if name not in params:
            raise ValueError(f"{model_dir}: weight {entry.name} does not belong to this model's config")
        param = params[name]
        _check_shape(entry, param, rows, shard, model_dir)
        if param.dtype == torch.uint8:  # a module kept in the file's blocks
            destination = block_rows(param, rows)
            gguf_quantized.read_blocks_into(entry, destination, shard)
        elif shard is not None and is_split(entry.name):  # the whole tensor once, this rank's part kept
            destination = param.data[rows] if rows is not None else param.data
            part = rank_part(entry.name, source.read_tensor(entry), shard)
            if part.numel() != destination.numel():
                raise ValueError(f"{entry.name}: shape {list(entry.shape)} does not fit this model's config")
            destination.copy_(part.reshape(destination.shape))
        else:
            destination = param.data[rows] if rows is not None else param.data
            source.read_into(entry, destination)
        order = grouped_rows(model.args.linear, entry.name)
        if order is not None:  # whole rows move: values, or a tensor's blocks
            destination.copy_(order.undo(destination.clone(), entry.name))
        filled[name] = filled.get(name, 0) + destination.numel()
    shared = {"lm_head.weight"} if model.args.tie_word_embeddings else set()
    missing = [n for n, p in params.items() if n not in shared and filled.get(n) != p.numel()]
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")
    if check_tensors:
        check_finite_model(model, model_dir)


def _fused_experts(params: dict[str, torch.Tensor], args: DecoderArgs, fused: tuple[int, str], entry,
                   by_name: dict, model_dir: str) -> dict[str, int]:
    """A fused experts tensor (float, or MXFP4's blocks with their scales), checked before it is read, into each
    expert's parameters; returns each parameter written and its elements."""
    layer, part = fused
    if part in MXFP4_PARTS:
        return load_mxfp4_part(params, args, layer, part, entry, by_name, model_dir)
    check_fused_part(args, layer, part, entry.shape, entry.dtype, model_dir)
    return split_fused_experts(params, args, layer, part, safetensors_files.read_tensor(entry), model_dir)


def _check_shape(entry, param: torch.Tensor, rows: slice | None, shard: Shard | None, model_dir: str) -> None:
    """The tensor's shape is the one the config gives its place (not just as many values): checked before
    a byte is read. Under tensor parallelism a split tensor's part is checked as it is cut."""
    if shard is not None and is_split(entry.name):
        return
    if param.dtype == torch.uint8:  # [rows, row bytes] of blocks: the rows, and a matrix
        expected = (block_rows(param, rows).shape[0], None)
        is_fit = len(entry.shape) == 2 and entry.shape[0] == expected[0]
    else:
        expected = tuple((param.data[rows] if rows is not None else param.data).shape)
        is_fit = tuple(entry.shape) == expected
    if not is_fit:
        wanted = [size if size is not None else "..." for size in expected]
        raise ValueError(f"{model_dir}: tensor {entry.name} has shape {list(entry.shape)}; this model's config "
                         f"makes it {wanted}")
