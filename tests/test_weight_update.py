"""coreserve/worker/models/weight_update.py on a model in this process: what it refuses before any copy."""

from __future__ import annotations

import pytest
import torch

from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.worker.models.loader import load_model
from coreserve.worker.models.weight_update import plan_update


def test_a_gguf_kept_quantized_refuses_new_weights_by_name():
    """dtype auto keeps SmolLM2's Q8_0 blocks: a float update of a blocked weight is refused, not cast."""
    model = load_model(builtin_model_path("smollm2"), "auto", torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"weights \(model.layers.0.mlp.up_proj.weight...\) are held in quantized"
    ):
        plan_update(model, [("model.layers.0.mlp.up_proj.weight", (1536, 576))])
