"""worker/cpu/huge_pages.py: the linear weights move into one huge-page mapping, values and ties intact."""

from __future__ import annotations

import torch

from worker.cpu.huge_pages import move_linear_weights_to_huge_pages
from worker.models.loader import load_model


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
