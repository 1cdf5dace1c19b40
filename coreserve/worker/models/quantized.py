"""Linear layers and an embedding table whose weights stay in a GGUF file's block format (Q8_0, Q4_0,
Q4_1, MXFP4: 32 weights a block; Q4_K, Q5_K, Q6_K: 256 weights a super-block), and their values (engine-core
process).

The weight is a uint8 tensor [N, K / 32 * block bytes], the file's bytes row by row, with the ggml
type kept on the module and on the tensor itself (`ggml_type_of`), so the readers that see only the
tensors (the fused decode forward) know what they read. A fused projection filled from GGUF tensors of
different types (a Q4_K_M file's Q4_K q and k beside a Q6_K v) keeps each run of rows in its own type:
its weight is the runs' bytes one after another, flat, of type QUANT_PARTS, the runs on the tensor
(`row_runs`). The values are those of the `gguf` package's
numpy dequantization, the ones a model dequantized at load holds; the CPU backend's C products
compute on the blocks directly with the same values (coreserve/worker/cpu/quant_linear.py). Elsewhere (no
compiler, CUDA) `forward` dequantizes the weight at each call: slow, the same numbers as the model
dequantized to fp32. docs/quantized.md.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# ggml type number -> (name, bytes per block, weights per block): the types kept quantized
QUANT_TYPES = {
    8: ("Q8_0", 34, 32),
    2: ("Q4_0", 18, 32),
    3: ("Q4_1", 20, 32),
    12: ("Q4_K", 144, 256),
    13: ("Q5_K", 176, 256),
    14: ("Q6_K", 210, 256),
    39: ("MXFP4", 17, 32),  # gpt-oss's experts: a scale byte (a power of two), 32 e2m1 nibbles
}
MXFP4 = 39


QUANT_PARTS = -1  # a weight of runs of rows of different types (csrc/kernel_parts.h's QUANT_PARTS)
Parts = tuple[tuple[int, int], ...]  # a QUANT_PARTS weight's runs in row order: (rows, ggml type)


def row_bytes(ggml_type: int, num_in: int) -> int:
    """Bytes of one weight row of `num_in` values."""
    _, block_bytes, block_weights = QUANT_TYPES[ggml_type]
    return num_in // block_weights * block_bytes


def can_quantize(ggml_type: int, num_in: int) -> bool:
    """Whether a row of `num_in` values of this type stays in its blocks (whole blocks, a known type)."""
    return ggml_type in QUANT_TYPES and num_in > 0 and num_in % QUANT_TYPES[ggml_type][2] == 0


def ggml_type_of(weight: torch.Tensor) -> int:
    """The ggml type of a weight kept in blocks (QUANT_PARTS for runs of several); 0 for a float tensor."""
    return getattr(weight, "ggml_type", 0)


def row_runs(weight: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """A weight kept in blocks as its runs of one type each, in row order: (ggml type, [rows, row bytes]
    uint8 view); one run for a weight of one type."""
    ggml_type = ggml_type_of(weight)
    if ggml_type != QUANT_PARTS:
        return [(ggml_type, weight)]
    runs, offset = [], 0
    for rows, part_type in weight.ggml_parts:
        size = rows * row_bytes(part_type, weight.ggml_width)
        runs.append((part_type, weight[offset : offset + size].view(rows, size // rows)))
        offset += size
    return runs


def block_rows(weight: torch.Tensor, rows: slice | None) -> torch.Tensor:
    """The [rows, row bytes] view of a block weight's rows `rows` (all where None), which lie in one run."""
    if ggml_type_of(weight) != QUANT_PARTS:
        return weight if rows is None else weight[rows]
    start, stop, step = (rows or slice(None)).indices(sum(r for r, _ in weight.ggml_parts))
    first = 0
    for _, run in row_runs(weight):
        if step == 1 and first <= start and stop <= first + run.shape[0]:
            return run[start - first : stop - first]
        first += run.shape[0]
    raise ValueError(f"rows {rows} cross the runs {weight.ggml_parts} of a weight of mixed types")


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """raw [R, row bytes] uint8 -> [R, K] float32: gguf's numpy routine, as the loader dequantizes."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType

    quant = getattr(gguf.quants, GGMLQuantizationType(ggml_type).name)
    rows = np.ascontiguousarray(raw.cpu().numpy())
    return torch.from_numpy(np.ascontiguousarray(quant.dequantize_rows(rows), dtype=np.float32))


def block_values(weight: torch.Tensor) -> torch.Tensor:
    """A weight kept in blocks (of one type or runs of several) -> its [N, K] float32 values."""
    return torch.cat([dequantize(run, t) for t, run in row_runs(weight)])


def _block_parameter(num_out: int, num_in: int, ggml_type: int | Parts) -> nn.Parameter:
    if isinstance(ggml_type, tuple):  # runs of different types, flat
        assert sum(rows for rows, _ in ggml_type) == num_out, (ggml_type, num_out)
        size = sum(rows * row_bytes(part_type, num_in) for rows, part_type in ggml_type)
        weight = nn.Parameter(torch.empty(size, dtype=torch.uint8), requires_grad=False)
        weight.ggml_type, weight.ggml_parts, weight.ggml_width = QUANT_PARTS, ggml_type, num_in
        return weight
    weight = nn.Parameter(
        torch.empty(num_out, row_bytes(ggml_type, num_in), dtype=torch.uint8), requires_grad=False
    )
    weight.ggml_type = ggml_type
    return weight


class QuantLinear(nn.Linear):
    """nn.Linear's interface (`in_features`, `out_features`, `bias`); `weight` holds the blocks."""

    def __init__(
        self, num_in: int, num_out: int, ggml_type: int | Parts, bias: nn.Parameter | None = None
    ) -> None:
        kinds = [t for _, t in ggml_type] if isinstance(ggml_type, tuple) else [ggml_type]
        assert all(can_quantize(t, num_in) for t in kinds), (ggml_type, num_in)
        nn.Module.__init__(self)
        self.in_features, self.out_features = num_in, num_out
        self.weight = _block_parameter(num_out, num_in, ggml_type)
        self.ggml_type = ggml_type_of(self.weight)
        self.bias = bias

    def share_blocks(self, weight: nn.Parameter) -> None:
        """Tied embeddings: the table's blocks are this layer's weight (one copy)."""
        assert ggml_type_of(weight) == self.ggml_type and weight.shape == self.weight.shape
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = block_values(self.weight).to(device=x.device, dtype=x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        runs = row_runs(self.weight)
        name = " + ".join(f"{run.shape[0]} rows {QUANT_TYPES[t][0]}" for t, run in runs) if len(runs) > 1 else (
            QUANT_TYPES[self.ggml_type][0])
        return f"in_features={self.in_features}, out_features={self.out_features}, {name}"


class QuantEmbedding(nn.Embedding):
    """nn.Embedding's interface; a lookup dequantizes the rows it reads, to float32."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ggml_type: int) -> None:
        assert can_quantize(ggml_type, embedding_dim), (ggml_type, embedding_dim)
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim, self.ggml_type = num_embeddings, embedding_dim, ggml_type
        self.padding_idx, self.max_norm, self.sparse = None, None, False
        self.weight = _block_parameter(num_embeddings, embedding_dim, ggml_type)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[input_ids.reshape(-1).cpu()]
        values = dequantize(rows, self.ggml_type).to(input_ids.device)
        return values.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {QUANT_TYPES[self.ggml_type][0]}"


def quantize_modules(model: nn.Module, plan: dict[str, int | Parts]) -> None:
    """Replaces the modules `plan` names (dotted paths: "layers.0.qkv_proj", "embed_tokens", "lm_head")
    with their block-format twins of the given ggml type (a linear layer: or runs of rows of several),
    storage allocated, values unset. A tied
    lm_head (whose weight is the embedding table's) shares the table's blocks."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    for path, ggml_type in plan.items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, name)
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantEmbedding(old.num_embeddings, old.embedding_dim, ggml_type)
        else:
            new = QuantLinear(old.in_features, old.out_features, ggml_type, old.bias)
        setattr(parent, name, new)
    if tied:
        table = model.embed_tokens
        if isinstance(table, QuantEmbedding):
            head = QuantLinear(table.embedding_dim, table.num_embeddings, table.ggml_type)
            head.share_blocks(table.weight)
            model.lm_head = head
        else:
            model.lm_head.weight = table.weight
