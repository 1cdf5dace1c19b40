"""coreserve: a multiprocess LLM inference engine with exact, cheap logprobs.

The face is vLLM's: `from coreserve import LLM, SamplingParams`. The four process roles are the folders
below (frontend, protocol, engine_core, worker; docs/architecture.md). The names resolve on first use, so
that the engine-core process, which imports `coreserve.engine_core`, never loads the frontend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it (all in the frontend's face, coreserve/frontend/__init__.py)
_FACE = {
    "AsyncLLM": "coreserve.frontend.async_llm",
    "ClassificationRequestOutput": "coreserve.frontend.pooling_outputs",
    "CompletionOutput": "coreserve.frontend.outputs",
    "EmbeddingRequestOutput": "coreserve.frontend.pooling_outputs",
    "EngineDeadError": "coreserve.frontend.errors",
    "LLM": "coreserve.frontend.llm",
    "Logprob": "coreserve.frontend.outputs",
    "LoRARequest": "coreserve.frontend.lora",
    "PoolingParams": "coreserve.protocol.pooling_params",
    "PoolingRequestOutput": "coreserve.frontend.pooling_outputs",
    "RequestFailedError": "coreserve.frontend.errors",
    "RequestOutput": "coreserve.frontend.outputs",
    "SamplingParams": "coreserve.protocol.sampling_params",
    "ScoringRequestOutput": "coreserve.frontend.pooling_outputs",
    "StructuredOutputsParams": "coreserve.protocol.structured_outputs",
}
__all__ = [
    "AsyncLLM",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineDeadError",
    "LLM",
    "Logprob",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from coreserve.frontend import (
        LLM,
        AsyncLLM,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        EngineDeadError,
        Logprob,
        LoRARequest,
        PoolingParams,
        PoolingRequestOutput,
        RequestFailedError,
        RequestOutput,
        SamplingParams,
        ScoringRequestOutput,
        StructuredOutputsParams,
    )


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module 'coreserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_FACE[name]), name)


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
