"""The linear layers' weights moved into transparent huge pages, on the CPU (engine-core process).

A decode step streams every linear weight once; in 4 KiB pages each page is a TLB miss and a restart
of the hardware prefetcher. One anonymous mapping advised MADV_HUGEPAGE holds them all instead (2 MiB
pages where the kernel grants them), which the few-row products read faster (docs/benchmarks.md).
Where the advice is refused or unknown, the weights stay where they are.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor's start, so no two tensors share a cache line or a 4 KiB page


def move_linear_weights_to_huge_pages(model: nn.Module, keep_values: bool = True) -> int:
    """Moves every nn.Linear weight (tied ones once) into one huge-page mapping, tensor by tensor, so
    memory peaks at the model plus one tensor. Returns the bytes moved (0 where not possible).
    `keep_values=False`: the weights are yet to be loaded, so only their place changes (no copy)."""
    weights = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}.values())
    if not weights or any(w.device.type != "cpu" for w in weights):
        return 0
    sizes = [-(-w.numel() * w.element_size() // _ALIGN) * _ALIGN for w in weights]
    memory = huge_page_bytes(sum(sizes))
    if memory is None:
        return 0
    offset = 0
    for weight, size in zip(weights, sizes):
        moved = memory[offset : offset + weight.numel() * weight.element_size()]
        moved = moved.view(weight.dtype).view(weight.shape)
        if keep_values:
            moved.copy_(weight.data)
        weight.data = moved  # the old storage is freed here, before the next tensor is copied
        offset += size
    return sum(sizes)


def zero_page_tensors(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """`count` zero tensors of `shape` in one anonymous mapping of ordinary pages, each on its own 4 KiB
    boundary; None where the mapping is refused (more than the machine's memory). A page is zero until
    written and committed when first written, so a large KV cache costs nothing at start (torch.zeros
    writes every byte). Not huge pages: a layer's cache is one slab per K/V head, and the first token
    would then zero a 2 MiB page in each."""
    num_bytes = math.prod(shape) * dtype.itemsize
    size = -(-num_bytes // _ALIGN) * _ALIGN
    try:
        mapping = mmap.mmap(-1, count * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        logger.info("no zero-page mapping of %d bytes (%s)", count * size, exc)
        return None
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    return [memory[i * size : i * size + num_bytes].view(dtype).view(shape) for i in range(count)]


def huge_page_bytes(num_bytes: int) -> torch.Tensor | None:
    """[num_bytes] uint8 in an anonymous mapping advised MADV_HUGEPAGE, starting on a huge-page
    boundary (the tensor keeps the mapping alive); None where the advice is refused or unknown."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        mapping = mmap.mmap(-1, num_bytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as exc:
        logger.info("no huge pages (%s)", exc)
        return None
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -memory.data_ptr() % _HUGE_PAGE
    return memory[offset : offset + num_bytes]
