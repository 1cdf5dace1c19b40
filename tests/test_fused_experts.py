"""gpt-oss's fused expert tensors (coreserve/worker/models/fused_experts.py): split into each expert with gate and
up de-interleaved, their sizes checked before a value is copied, and refused by name where not built (new
weights). The model's numbers against HF's: test_model_families.py."""

from __future__ import annotations

import pytest
import torch

from coreserve.worker.models.fused_experts import fused_expert_part, split_fused_experts
from coreserve.worker.models.loader import load_model
from coreserve.worker.models.weight_update import plan_update


@pytest.fixture(scope="module")
def model(family_model):
    return load_model(family_model("gpt_oss"), "float32", torch.device("cpu"))


def test_gate_and_up_are_deinterleaved_into_each_experts_halves(model):
    args = model.args
    params = dict(model.named_parameters())
    fused = torch.randn(args.moe.num_experts, args.hidden_size, 2 * args.moe.intermediate_size)
    assert fused_expert_part(args, "model.layers.1.mlp.experts.gate_up_proj") == (1, "gate_up_proj")
    split_fused_experts(params, args, 1, "gate_up_proj", fused, "folder")
    weight = model.layers[1].moe.experts[2].gate_up_proj.weight  # [2 I, hidden]: gate rows, then up rows
    width = args.moe.intermediate_size
    assert torch.equal(weight[:width], fused[2, :, 0::2].t()) and torch.equal(weight[width:], fused[2, :, 1::2].t())


def test_a_fused_tensor_of_another_shape_or_of_integers_is_refused_by_name(model):
    args = model.args
    wrong = torch.zeros(args.moe.num_experts, args.moe.intermediate_size, args.hidden_size + 1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj has shape"):
        split_fused_experts(dict(model.named_parameters()), args, 0, "down_proj", wrong, "folder")
    integers = torch.zeros(args.moe.num_experts, args.hidden_size, dtype=torch.int32)
    with pytest.raises(ValueError, match="down_proj_bias has dtype torch.int32"):
        split_fused_experts(dict(model.named_parameters()), args, 0, "down_proj_bias", integers, "folder")


def test_new_weights_for_fused_experts_are_refused_by_name(model):
    shape = (model.args.moe.num_experts, model.args.hidden_size, 2 * model.args.moe.intermediate_size)
    with pytest.raises(ValueError, match="fused experts"):
        plan_update(model, [("model.layers.0.mlp.experts.gate_up_proj", shape)])
