"""coreserve/worker/cpu/huge_pages.py: the linear weights move into one huge-page mapping, values and ties intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coreserve.worker.cpu.huge_pages import (
    collapse_in_background,
    huge_page_bytes,
    move_linear_weights_to_huge_pages,
)
from coreserve.worker.models.loader import load_model


def test_weights_move_with_their_values_dtypes_and_ties(tiny_path):
    model = load_model(tiny_path, "float32", torch.device("cpu"))
    model.lm_head.weight = model.embed_tokens.weight  # tied, as some checkpoints are
    model.layers[0].o_proj.weight.data = model.layers[0].o_proj.weight.data.to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    moved = move_linear_weights_to_huge_pages(model)
    assert moved >= sum(p.numel() * p.element_size() for p in before.values() if p.dim() == 2) // 2
    for name, param in model.named_parameters(remove_duplicate=False):
        assert param.dtype == before[name].dtype and torch.equal(param, before[name]), name
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].qkv_proj.weight.data_ptr() % 4096 == 0
    assert torch.equal(model.embed_tokens(torch.tensor([5, 7])), before["embed_tokens.weight"][[5, 7]])


def _huge_kib_at(address: int) -> int | None:
    """AnonHugePages (KiB) of this process's mapping that holds `address`; None if none does."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            found = low <= address < high
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


@pytest.mark.skipif(
    "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(errors="ignore")
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() else True,
    reason="no transparent huge pages on this kernel",
)
def test_written_weights_collapse_into_huge_pages_in_place_afterwards():
    """The weights are written into ordinary pages (no compaction on the first token's path); the
    background thread turns them into huge pages with the same address and the same values."""
    memory = huge_page_bytes(8 << 20, advise=False)
    assert memory is not None and memory.data_ptr() % (2 << 20) == 0
    values = torch.arange(memory.numel() // 4, dtype=torch.int32)
    memory.view(torch.int32).copy_(values)
    address = memory.data_ptr()
    assert _huge_kib_at(address) == 0  # not advised: ordinary pages, whatever the kernel's defrag mode
    collapse_in_background(memory).join(timeout=60)
    assert memory.data_ptr() == address and torch.equal(memory.view(torch.int32), values)
    huge = _huge_kib_at(address)
    if huge == 0:
        pytest.skip("the kernel granted no huge page (MADV_COLLAPSE unsupported or memory too fragmented)")
    assert huge >= 2048
