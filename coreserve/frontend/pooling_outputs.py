"""What a pooling engine's users get back, with vLLM's names (frontend process): PoolingRequestOutput (its
PoolingOutput's `data`), and the task's views of it, EmbeddingRequestOutput (`.outputs.embedding`),
ClassificationRequestOutput (`.outputs.probs`) and ScoringRequestOutput (`.outputs.score`).

One difference from vLLM: `PoolingOutput.data` is a float32 numpy array, not a torch tensor (the frontend
does not load torch; `torch.from_numpy` turns it into one without a copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

_O = TypeVar("_O")


@dataclass
class PoolingOutput:
    data: np.ndarray  # [size] float32: the embedding, or the classifier's label values


@dataclass
class PoolingRequestOutput(Generic[_O]):
    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # a pooling prompt reads no prefix cache (runner="pooling")


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # each label's probability (its raw logit with use_activation=False)

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ClassificationOutput:
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ScoringOutput:
        return cls(float(output.data[0]))


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput.from_base(output.outputs), output.prompt_token_ids,
                   output.finished)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(output.request_id, ClassificationOutput.from_base(output.outputs), output.prompt_token_ids,
                   output.finished)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ScoringRequestOutput:
        return cls(output.request_id, ScoringOutput.from_base(output.outputs), output.prompt_token_ids,
                   output.finished)
