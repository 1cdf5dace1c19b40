"""New weights into a running model, in place (engine-core process, and each tensor-parallel rank).

The tensors come from a safetensors file (a trainer's state written to /dev/shm by the frontend) or a
checkpoint folder, under Hugging Face names, the whole state or a part of it. Every tensor is checked
(name, shape) before any is copied, so a bad update raises a ValueError and the old weights keep
serving. Copies go into the parameters' own memory (`copy_`, converting the dtype): the fused q/k/v
and gate/up row blocks, huge-page mappings and the C backend's descriptors, which hold the parameters'
addresses, stay valid as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.finite_weights import check_finite_tensor
from coreserve.worker.models.fused_experts import fused_expert_part
from coreserve.worker.models.grouped_rows import GroupedRows, grouped_rows
from coreserve.worker.models.sharding import Shard, is_split, rank_part
from coreserve.worker.models.weight_names import weight_destination  # the loader's one map of HF names

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_paths(path: str) -> list[Path]:
    """The file itself, or every .safetensors file of a folder."""
    where = Path(path)
    if where.is_file():
        return [where]
    if where.is_dir():
        files = sorted(where.glob("*.safetensors"))
        if files:
            return files
    if not where.exists():
        raise ValueError(
            f"update_weights: {path} does not exist on the engine core's machine; tensors travel as a file "
            "in the frontend's /dev/shm, so a daemon on another host cannot read them: run the daemon on "
            "the trainer's machine, or pass a checkpoint path that the daemon's machine can read"
        )
    raise ValueError(f"update_weights: {path} is neither a safetensors file nor a folder holding some")


def update_weights_from_path(
    model: DecoderModel, path: str, shard: Shard | None = None, check_tensors: bool = True
) -> int:
    """Loads every tensor of `path` into the model; returns how many tensors changed. `check_tensors`:
    a NaN or an infinity anywhere refuses the update before anything is copied."""
    with _opened(path) as named:
        plan = plan_update(model, [(n, tuple(s.get_shape())) for n, s in named.items()], shard)
        for name, _ in plan if check_tensors else ():  # read before any copy: a bad one leaves the old weights
            check_finite_tensor(named[name][:], name, "update_weights refused, the weights are unchanged")
        for name, target in plan:
            copy_into(target, named[name], name, shard, grouped_rows(model.args.linear, name))
    return len(plan)


def check_weights(
    model: DecoderModel,
    path: str,
    shard: Shard | None = None,
    params: dict[str, torch.Tensor] | None = None,
    is_whole: bool = False,  # every weight must be there (after sleep level 2)
) -> int:
    """Every name and shape of `path` checked against the model, nothing copied (a ValueError as
    update_weights_from_path's); returns how many tensors an update would change."""
    with _opened(path) as named:
        plan = plan_update(model, [(n, tuple(s.get_shape())) for n, s in named.items()], shard, params)
    if is_whole:
        filled: dict[str, int] = {}
        for name, view in plan:
            target = weight_destination(model.args, name)[0]
            filled[target] = filled.get(target, 0) + view.numel()
        params = params if params is not None else dict(model.named_parameters(remove_duplicate=False))
        tied = {"lm_head.weight"} if model.args.tie_word_embeddings else set()
        missing = sorted(n for n, p in params.items() if n not in tied and filled.get(n) != p.numel())
        if missing:
            raise ValueError(f"the weights were dropped (sleep level 2): an update must hold them all; "
                             f"{len(missing)} missing, as {missing[:3]}")
    return len(plan)


@contextmanager
def _opened(path: str) -> Iterator[dict]:
    """HF name -> a lazy slice of the memory-mapped file (a file in /dev/shm is read where it lies)."""
    from safetensors import safe_open

    files = safetensors_paths(path)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
        yield {name: handle.get_slice(name) for handle in handles for name in handle.keys()}


def plan_update(
    model: DecoderModel,
    shapes: list[tuple[str, tuple[int, ...]]],
    shard: Shard | None = None,
    params: dict[str, torch.Tensor] | None = None,  # None: the model's; else stand-ins of their shapes
) -> list[tuple[str, torch.Tensor]]:
    """(HF name, the parameter view it fills) for each tensor, every name and shape checked first;
    a ValueError names the first that does not fit. Tied checkpoints' lm_head.weight is skipped."""
    if params is None:
        params = dict(model.named_parameters(remove_duplicate=False))
    plan, errors, quantized = [], [], []
    for name, shape in shapes:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.args.tie_word_embeddings):
            continue
        if fused_expert_part(model.args, name) is not None:
            errors.append(f"{name}: new weights for fused experts (gpt-oss's 3-D tensors) are not built")
            continue
        target = weight_destination(model.args, name)
        if target is None or target[0] not in params:
            errors.append(f"{name} is not a weight of this model")
            continue
        param, rows = params[target[0]], target[1]
        view = param.data[rows] if rows is not None else param.data  # a view: copies land in the model
        if view.dtype == torch.uint8:  # a GGUF module kept in its blocks (coreserve/worker/models/gguf_quantized.py)
            quantized.append(name)
            continue
        expected = full_shape(name, tuple(view.shape), shard)
        if tuple(shape) != expected:
            errors.append(f"{name} has shape {list(shape)}; the model's is {list(expected)}")
            continue
        plan.append((name, view))
    if quantized:
        errors.insert(0, f"{len(quantized)} weights ({', '.join(quantized[:3])}...) are held in quantized "
                         "blocks: new weights need an engine started with dtype float32 or bfloat16")
    if errors:
        raise ValueError(f"update_weights refused, the weights are unchanged: {'; '.join(errors[:5])}")
    return plan


def full_shape(name: str, part_shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    """The HF tensor's shape whose part (on this rank) has `part_shape`."""
    if shard is None or not is_split(name) or name.endswith("self_attn.o_proj.bias"):
        return part_shape
    dim = 1 if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) else 0
    return tuple(size * shard.size if d == dim else size for d, size in enumerate(part_shape))


def copy_into(target: torch.Tensor, lazy, name: str, shard: Shard | None, order: GroupedRows | None = None) -> None:
    """Reads from the file only what this rank keeps (its rows or columns of a split tensor); `order`: the
    rows' grouping to undo (Qwen3-Next's in_proj_qkvz and in_proj_ba, as at load)."""
    if shard is not None and is_split(name):
        tensor = _rank_slice(lazy, name, shard)
    else:
        tensor = lazy[:]
    if order is not None:
        tensor = order.undo(tensor, name)
    target.copy_(tensor.reshape(target.shape))  # converts the dtype (bf16 <-> fp32) and the device


def _rank_slice(lazy, name: str, shard: Shard) -> torch.Tensor:
    """rank_part's rows or columns, sliced out of the file (the same split: equal contiguous chunks)."""
    if name.endswith("self_attn.o_proj.bias"):
        return rank_part(name, lazy[:], shard)
    shape = lazy.get_shape()
    dim = 1 if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) else 0
    size = shape[dim] // shard.size
    part = slice(shard.rank * size, (shard.rank + 1) * size)
    return lazy[part] if dim == 0 else lazy[:, part]
