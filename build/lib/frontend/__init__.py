"""The user-facing side of coreserve: LLM, SamplingParams and the output types (frontend process)."""

from frontend.async_llm import AsyncLLM
from frontend.errors import EngineDeadError, RequestFailedError
from frontend.llm import LLM
from frontend.lora import LoRARequest
from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from protocol.sampling_params import SamplingParams
from protocol.structured_outputs import StructuredOutputsParams

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
]
