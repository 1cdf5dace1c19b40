"""The linear layers' weights moved into transparent huge pages, on the CPU (engine-core process).

A decode step streams every linear weight once; in 4 KiB pages each page is a TLB miss and a restart
of the hardware prefetcher. One anonymous mapping holds them all instead, turned into 2 MiB pages
where the kernel grants them, which the few-row products read faster (docs/benchmarks.md).
The weights are written into ordinary pages and collapsed into huge ones afterwards, by a thread at
the lowest priority (MADV_COLLAPSE, Linux 6.1+; before that the advice alone lets khugepaged do it):
with the kernel's usual `defrag=madvise`, a 2 MiB fault in an advised region compacts memory first,
which cost 13 ms a page here (6.8 s for 512 MiB, against 0.3 s in ordinary pages), and that must not
stand between a restart and the first token. The weights' addresses never change.
Where the mapping is refused, the weights stay where they are.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor's start, so no two tensors share a cache line or a 4 KiB page
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # <sys/mman.h>; Python's mmap module lacks MADV_COLLAPSE
_COLLAPSE_CHUNK = 2 << 20  # one huge page a call (13 ms here): a step that starts meanwhile waits little
COLLAPSE_DELAY_S = 5.0  # the runner's wait before collapsing: short-lived engines never collapse
_MAX_DEFER_S = 30.0  # a core that never stops stepping gets its huge pages after this, a page at a time


def move_linear_weights_to_huge_pages(model: nn.Module, keep_values: bool = True) -> int:
    """Moves every nn.Linear weight (tied ones once) into one huge-page mapping, tensor by tensor, so
    memory peaks at the model plus one tensor, and starts their collapse into huge pages
    (`collapse_in_background`). Returns the bytes moved (0 where not possible)."""
    memory = place_linear_weights(model, keep_values)
    if memory is None:
        return 0
    collapse_in_background(memory)
    return memory.numel()


def place_linear_weights(model: nn.Module, keep_values: bool = True) -> torch.Tensor | None:
    """Moves every nn.Linear weight (tied ones once) into one mapping of ordinary pages on a huge-page
    boundary, tensor by tensor; returns the mapping's bytes (None where not possible) for
    `collapse_in_background` once the weights are written. `keep_values=False`: the weights are yet
    to be loaded, so only their place changes (no copy)."""
    weights = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}.values())
    if not weights or any(w.device.type != "cpu" for w in weights):
        return 0
    sizes = [-(-w.numel() * w.element_size() // _ALIGN) * _ALIGN for w in weights]
    memory = huge_page_bytes(sum(sizes), advise=False)
    if memory is None:
        return None
    offset = 0
    for weight, size in zip(weights, sizes):
        moved = memory[offset : offset + weight.numel() * weight.element_size()]
        moved = moved.view(weight.dtype).view(weight.shape)
        if keep_values:
            moved.copy_(weight.data)
        weight.data = moved  # the old storage is freed here, before the next tensor is copied
        offset += size
    return memory


def collapse_in_background(
    memory: torch.Tensor, busy: Callable[[], bool] | None = None, delay_s: float = 0.0,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """Advises `memory` (from `huge_page_bytes`) MADV_HUGEPAGE and collapses it into huge pages, one at a
    time, in a daemon thread at the lowest priority; the values and addresses stay. While `busy()` (the
    runner stepped lately) it waits, up to _MAX_DEFER_S in all: a collapse beside a step made the first
    token 0.3-0.7 s late instead of 0.08. `delay_s`: first wait this long, so an engine that lives a
    few seconds (a script, a test) does not pay the compaction at all. The thread holds the memory (and
    `busy`'s owner) until it is done or `stop` is set: a closed engine sets it, so an in-process engine
    gives its memory back when it closes, not seconds later."""
    args = (memory, busy, delay_s, stop or threading.Event())
    thread = threading.Thread(target=_collapse, args=args, name="huge-page-collapse", daemon=True)
    thread.start()
    return thread


def _collapse(
    memory: torch.Tensor, busy: Callable[[], bool] | None, delay_s: float, stop: threading.Event
) -> None:
    if stop.wait(delay_s):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
    except (AttributeError, OSError):
        pass
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    start, size = memory.data_ptr(), -(-memory.numel() // _HUGE_PAGE) * _HUGE_PAGE
    if madvise(start, size, _MADV_HUGEPAGE) != 0:
        logger.info("no huge pages (madvise: errno %d)", ctypes.get_errno())
        return
    deferred_until = time.monotonic() + _MAX_DEFER_S
    for offset in range(0, size, _COLLAPSE_CHUNK):  # ctypes lets go of the GIL for each call
        while busy is not None and busy() and time.monotonic() < deferred_until:
            stop.wait(0.05)
        if stop.is_set():
            return
        if madvise(start + offset, min(_COLLAPSE_CHUNK, size - offset), _MADV_COLLAPSE) != 0:
            logger.info("huge pages left to khugepaged (MADV_COLLAPSE: errno %d)", ctypes.get_errno())
            return


def zeroed_kv_caches(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed KV cache a layer: zero pages on the CPU, committed as blocks are first written
    (writing 2 GiB of zeros would be a second of start-up; a cache larger than the machine's memory is
    refused by the mapping); torch.zeros elsewhere, or where the mapping is refused."""
    caches = zero_page_tensors(num_layers, shape, dtype) if device.type == "cpu" else None
    return caches or [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


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


def huge_page_bytes(num_bytes: int, advise: bool = True) -> torch.Tensor | None:
    """[num_bytes] uint8 in an anonymous mapping starting on a huge-page boundary (the tensor keeps the
    mapping alive), advised MADV_HUGEPAGE now (`advise`) or left for `collapse_in_background`; None
    where the advice is refused or unknown."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        size = -(-num_bytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE  # whole huge pages from the boundary
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if advise:
            mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as exc:
        logger.info("no huge pages (%s)", exc)
        return None
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -memory.data_ptr() % _HUGE_PAGE
    return memory[offset : offset + num_bytes]
