"""The linear layers' weights moved into transparent huge pages, on the CPU (engine-core process).

A decode step streams every linear weight once; in 4 KiB pages each page is a TLB miss and a restart
of the hardware prefetcher. One anonymous mapping advised MADV_HUGEPAGE holds them all instead (2 MiB
pages where the kernel grants them), which the few-row products read faster (docs/benchmarks.md).
Where the advice is refused or unknown, the weights stay where they are.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor's start, so no two tensors share a cache line or a 4 KiB page


def move_linear_weights_to_huge_pages(model: nn.Module) -> int:
    """Moves every nn.Linear weight (tied ones once) into one huge-page mapping, tensor by tensor, so
    memory peaks at the model plus one tensor. Returns the bytes moved (0 where not possible)."""
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
        moved.copy_(weight.data)
        weight.data = moved  # the old storage is freed here, before the next tensor is copied
        offset += size
    return sum(sizes)


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
