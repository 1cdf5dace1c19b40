"""The pooling runner's last step (engine-core process): each finished prompt's final hidden states into one
vector, by its PoolingSpec (coreserve/worker/pooling/pooling_spec.py): the pooled row (a mean, the first or
last token, or a classifier's last non-pad token), then the sentence-transformers Dense layers and the L2
norm (embed), or the model's score head and its activation (classify).

Each request is pooled on its own rows alone, in a fixed order: the mean a running sum down the rows (one
order, whatever the thread count), every product the model ops' `linear` (gemv.c's one order on the CPU
backend), so a request's vector is the same bits in any batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.finite_weights import check_finite_tensor
from coreserve.worker.models.loader import read_config
from coreserve.worker.models.safetensors_files import read_header, read_into
from coreserve.worker.pooling.pooling_spec import PoolingSpec, pooling_spec, resolve_runner
from coreserve.worker.step.input_batch import PoolJob


def build_pooler(runner: str, model_dir: str, args: DecoderArgs, device: torch.device) -> Pooler | None:
    """The pooler of a model the pooling runner serves (`runner` "auto" resolved by the model); None: the
    engine generates."""
    if resolve_runner(runner, model_dir, args) == "generate":
        return None
    return Pooler(pooling_spec(model_dir, read_config(model_dir), args), device)


class Pooler(nn.Module):
    """The spec's Dense layers, read from their files (fp32, checked finite); the score head is the model's."""

    def __init__(self, spec: PoolingSpec, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.dense = nn.ModuleList()
        for layer in spec.dense:
            linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.has_bias, device=device)
            for entry in read_header(layer.weights):
                target = linear.weight if entry.name == "linear.weight" else linear.bias
                read_into(entry, target.data)
                check_finite_tensor(target.data, entry.name, str(layer.weights))
            self.dense.append(linear.requires_grad_(False))

    @torch.inference_mode()
    def pool(self, model: DecoderModel, hidden: torch.Tensor, jobs: list[PoolJob]) -> dict[str, np.ndarray]:
        """hidden: the step's final-normed hidden states [T, hidden]. Returns req_id -> [size] float32."""
        return {job.req_id: self._one(model, hidden[job.first_row : job.first_row + job.num_rows], job)
                for job in jobs}

    def _one(self, model: DecoderModel, rows: torch.Tensor, job: PoolJob) -> np.ndarray:
        """rows: the request's [P, hidden] -> its vector."""
        spec, ops = self.spec, model.ops
        row = self._pooled(rows, job.token_ids)[None, :]  # [1, hidden]
        if spec.task == "classify":
            logits = ops.linear(model.score, row).float()[0]
            return _activated(logits, spec.activation if job.params.activation(True) else "identity")
        x = row.float()
        for layer, dense in zip(self.dense, spec.dense):
            x = ops.linear(layer, x)
            if dense.activation == "tanh":
                x = torch.tanh(x)
        x = x[0]
        if job.params.dimensions is not None:  # Matryoshka: the leading values, then normalized
            x = x[: job.params.dimensions]
        if job.params.activation(spec.normalizes):
            x = x / torch.linalg.vector_norm(x).clamp_min(1e-12)  # sentence-transformers' F.normalize
        return x.float().cpu().numpy()

    def _pooled(self, rows: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """[P, hidden] -> [hidden] by the spec's pooling."""
        kind = self.spec.pooling
        if kind == "mean":  # a running sum, one row after the other: one order of additions
            return rows.float().cumsum(dim=0)[-1] / rows.shape[0]
        if kind == "cls":
            return rows[0]
        if kind == "last":
            return rows[-1]
        return rows[_last_non_pad(token_ids, self.spec.pad_token_id)]


def _last_non_pad(token_ids: list[int], pad_token_id: int | None) -> int:
    """HF's *ForSequenceClassification row: the last position whose token is not the pad (0 where every
    token is; the last where the model has no pad id)."""
    if pad_token_id is None:
        return len(token_ids) - 1
    return max((i for i, token in enumerate(token_ids) if token != pad_token_id), default=0)


def _activated(logits: torch.Tensor, activation: str) -> np.ndarray:
    if activation == "softmax":
        logits = logits.softmax(dim=-1)
    elif activation == "sigmoid":
        logits = logits.sigmoid()
    return logits.cpu().numpy()
