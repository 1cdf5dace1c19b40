"""The user-facing side of coreserve: LLM, SamplingParams and the output types (frontend process)."""

from coreserve.frontend.async_llm import AsyncLLM
from coreserve.frontend.errors import EngineDeadError, RequestFailedError
from coreserve.frontend.llm import LLM
from coreserve.frontend.lora import LoRARequest
from coreserve.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from coreserve.frontend.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from coreserve.protocol.pooling_params import PoolingParams
from coreserve.protocol.sampling_params import SamplingParams
from coreserve.protocol.structured_outputs import StructuredOutputsParams

__all__ = [
    "AsyncLLM",
    "LLM",
    "CompletionOutput",
    "EngineDeadError",
    "Logprob",
    "LoRARequest",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
]
